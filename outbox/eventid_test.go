package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// The README way: a fresh watermill.NewUUID() for every publish, the event's
// id in the payload. Publishing the same payload twice (a retried producer)
// writes two rows with one event id, the payload's, and a dedup consumer
// behind the forwarder applies it once.
func TestOutbox_SamePayloadTwice_OneEventID_AppliedOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	topic := e.topic(t, "payload-id", 2)
	e.db.Exec(t, `CREATE TABLE applied (event_id uuid NOT NULL)`)

	x := publisher.NewEventID()
	payload := []byte(`{"eventId":"` + x.String() + `","orderId":"order-42","total":1200}`)
	for range 2 {
		msg := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), "order-42")
		e.publishTx(t, topic, msg)
	}
	require.Equal(t, 2, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topic)+` WHERE metadata->>'event_id' = $1`, x.String()),
		"both rows carry the payload's eventId as event_id")

	e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})

	// The consumer: a router with the dedup middleware.
	ctx := context.Background()
	logger := watermill.NopLogger{}
	const group = "payload-id-consumer"
	table := deduplicator.TableConfig{Schema: e.db.Schema}
	require.NoError(t, migrate.Up(ctx, e.db.Pool, deduplicator.MigrationLine(table)))
	dedup, err := idem.NewDedup(idem.Config{DB: e.db.Pool, ConsumerGroup: group, Table: table}, logger)
	require.NoError(t, err)
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: e.broker.Addrs}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(dedup.Middleware)
	router.AddConsumerHandler(group, topic, sub, func(m *message.Message) error {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO applied VALUES ($1)`, id)
		return err
	})
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() {
		_ = router.Close()
		_ = sub.Close()
	})
	<-router.Running()

	require.Eventually(t, func() bool {
		st := dedup.Stats()
		return st.Processed+st.Duplicates == 2
	}, eventuallyTimeout, 20*time.Millisecond, "both copies consumed")
	st := dedup.Stats()
	require.EqualValues(t, 1, st.Processed)
	require.EqualValues(t, 1, st.Duplicates, "the second copy is the same event")
	require.Zero(t, st.Rejected)
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM applied`), "applied once")
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM applied WHERE event_id = $1`, x))
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM processed_event WHERE event_id = $1 AND consumer_group = $2`, x, group))
}

// A payload eventId that is not a UUIDv7, or that disagrees with the
// event_id metadata, is refused by every write path of the outbox, and
// nothing of the call is written, even when the caller's transaction
// commits.
func TestOutbox_BadPayloadEventIDWritesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0, "orders")
	table := e.outbox.MessagesTable("orders")

	good := func() *message.Message {
		return message.NewMessage(watermill.NewUUID(), []byte(`{"eventId":"`+publisher.NewEventID().String()+`"}`))
	}
	notV7 := func() *message.Message {
		return message.NewMessage(watermill.NewUUID(), []byte(`{"eventId":"`+uuid.NewString()+`"}`))
	}
	malformed := func() *message.Message {
		return message.NewMessage(watermill.NewUUID(), []byte(`{"eventId":"order-42"}`))
	}
	mismatch := func() *message.Message {
		m := good()
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		return m
	}
	cases := []struct {
		name string
		bad  func() *message.Message
		want error
	}{
		{"payload eventId not a UUIDv7", notV7, publisher.ErrNotUUIDv7},
		{"payload eventId malformed", malformed, publisher.ErrInvalidEventID},
		{"header and payload disagree", mismatch, publisher.ErrEventIDMismatch},
	}
	paths := map[string]func(*message.Message, *message.Message) error{
		"Publisher(tx)": func(m1, m2 *message.Message) error {
			tx, err := e.db.Pool.Begin(ctx)
			require.NoError(t, err)
			perr := e.outbox.Publisher(tx).Publish("orders", m1, m2)
			require.NoError(t, tx.Commit(ctx), "the caller's transaction is still usable")
			return perr
		},
		"PublishInTx": func(m1, m2 *message.Message) error {
			tx, err := e.db.Pool.Begin(ctx)
			require.NoError(t, err)
			hctx := idemctx.With(ctx, &idemctx.Value{Tx: tx, EventID: publisher.NewEventID()})
			perr := e.outbox.PublishInTx(hctx, tx, "orders", m1, m2)
			require.NoError(t, tx.Commit(ctx))
			return perr
		},
		"PoolPublisher": func(m1, m2 *message.Message) error {
			return e.outbox.PoolPublisher(e.db.Pool).Publish("orders", m1, m2)
		},
	}
	for _, c := range cases {
		for path, publish := range paths {
			err := publish(good(), c.bad())
			require.ErrorIs(t, err, c.want, "%s via %s", c.name, path)
			require.True(t, idem.IsPermanent(err), "%s via %s", c.name, path)
			var se *publisher.EventIDError
			require.ErrorAs(t, err, &se, "%s via %s", c.name, path)
			require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+table), "%s via %s: no row", c.name, path)
		}
	}
}
