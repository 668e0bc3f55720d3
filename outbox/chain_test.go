package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A → B → C: A publishes through the outbox; B consumes with dedup, writes
// a row and returns a message (the middleware writes it to the outbox in
// the same transaction); C consumes with dedup, writes a row and publishes
// through PublisherFromContext. Duplicates are injected at every hop: A
// writes every event twice, and every outbox table is forwarded by two
// forwarders of different names, so each Kafka topic carries each event 4 or 2 times.
func TestChain_DuplicatesAtEveryHop_OneRowPerEventPerStep(t *testing.T) {
	t.Parallel()
	const n = 100
	e := newEnv(t, 16)
	topicA := e.topic(t, "chain-a", 2)
	topicB := e.topic(t, "chain-b", 2)
	topicC := e.topic(t, "chain-c", 1)
	e.db.Exec(t, `CREATE TABLE b_rows (event_id uuid NOT NULL)`)
	e.db.Exec(t, `CREATE TABLE c_rows (event_id uuid NOT NULL, causation_id uuid NOT NULL)`)

	// Hop A: each event written twice (a retried producer), same event_id.
	for i := 0; i < n; i++ {
		msg := event("customer-"+string(rune('a'+i%26)), i)
		e.publishTx(t, topicA, msg)
		dup := message.NewMessage(watermill.NewUUID(), msg.Payload)
		for k, v := range msg.Metadata {
			dup.Metadata.Set(k, v)
		}
		e.publishTx(t, topicA, dup)
	}
	require.Equal(t, 2*n, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topicA)))
	for _, g := range []string{"fwd-1", "fwd-2"} {
		e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topicA, topicB}, Name: g})
	}

	// Step B: handler-returned messages go to the outbox in the claim's tx.
	e.service(t, topicA, "svc-b", topicB, func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO b_rows VALUES ($1)`, id); err != nil {
			return nil, err
		}
		out := message.NewMessage(watermill.NewUUID(), m.Payload)
		publisher.WithPartitionKey(out, m.Metadata.Get(publisher.MetadataPartitionKey))
		return []*message.Message{out}, nil
	})

	// Step C: publishes through the handler's transaction.
	e.service(t, topicB, "svc-c", "", func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO c_rows VALUES ($1, $2::uuid)`, id, m.Metadata.Get(publisher.MetadataCausationID)); err != nil {
			return nil, err
		}
		pub, err := e.outbox.PublisherFromContext(ctx)
		if err != nil {
			return nil, err
		}
		return nil, pub.Publish(topicC, message.NewMessage(watermill.NewUUID(), m.Payload))
	})

	// Every copy consumed on both hops: A carries 2n rows × 2 forwarders,
	// B carries n rows × 2 forwarders.
	require.Eventually(t, func() bool {
		return groupOffsets(t, e.broker.Addrs, "svc-b", topicA) == 4*n &&
			groupOffsets(t, e.broker.Addrs, "svc-c", topicB) == 2*n
	}, eventuallyTimeout, 50*time.Millisecond)

	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM b_rows`))
	require.Equal(t, n, e.db.Count(t, `SELECT DISTINCT event_id FROM b_rows`))
	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topicB)))
	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM c_rows`))
	require.Equal(t, n, e.db.Count(t, `SELECT DISTINCT event_id FROM c_rows`))
	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topicC)))

	// Causation links each step to the previous one; the correlation id is
	// A's event id all along the chain.
	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM c_rows c JOIN `+e.outbox.MessagesTable(topicB)+` b
		ON (b.metadata->>'event_id')::uuid = c.event_id AND (b.metadata->>'causation_id')::uuid = c.causation_id
		JOIN b_rows ON b_rows.event_id = c.causation_id`))
	require.Equal(t, n, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topicC)+` oc
		JOIN c_rows c ON (oc.metadata->>'causation_id')::uuid = c.event_id
		JOIN b_rows b ON b.event_id = c.causation_id
		WHERE (oc.metadata->>'correlation_id')::uuid = b.event_id`))
}
