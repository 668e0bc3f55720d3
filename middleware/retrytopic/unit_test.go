package retrytopic_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// unit runs docs/retry.md's chain with KeyOrder on an in-memory pub/sub,
// one delivery at a time: deliver hands a message to the main or the retry
// handler and returns what the chain returned (the message is acked either
// way, nothing is redelivered unless the test delivers it again). The
// copies of failed events are captured, not delivered, and the hand-offs
// stay in the outbox table (no forwarder): the test delivers them when it
// chooses, which is how it plays the crash cases.
type unit struct {
	db    *pgtest.DB
	ps    *gochannel.GoChannel
	rt    *retrytopic.RetryTopic
	ob    *outbox.Outbox
	table retrytopic.ParkedKeysTable

	mu      sync.Mutex
	fail    map[event]int // event → failures left
	copies  []*message.Message
	results chan error
}

const (
	unitMain   = "orders"
	unitRetry  = "orders.retry"
	unitPoison = "orders.poison"
	unitGroup  = "billing"
)

// capture is the retry-topic middleware's publisher: it keeps the copies.
type capture struct{ u *unit }

func (c capture) Publish(_ string, msgs ...*message.Message) error {
	c.u.mu.Lock()
	defer c.u.mu.Unlock()
	c.u.copies = append(c.u.copies, msgs...)
	return nil
}

func (capture) Close() error { return nil }

func newUnit(t *testing.T, mod func(*retrytopic.Config)) *unit {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	require.NoError(t, deduplicator.Migrate(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema}))
	u := &unit{db: db, table: retrytopic.ParkedKeysTable{Schema: db.Schema}, fail: map[event]int{}, results: make(chan error, 1)}
	require.NoError(t, retrytopic.Migrate(ctx, db.Pool, u.table))
	db.Exec(t, `CREATE TABLE ledger (seq bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL)`)
	var err error
	u.ob, err = outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{unitRetry}}, nil)
	require.NoError(t, err)
	require.NoError(t, u.ob.Migrate(ctx, db.Pool))
	cfg := retrytopic.Config{
		Publisher: capture{u}, Topics: []string{unitRetry}, PoisonTopic: unitPoison, MaxAttempts: 3,
		Backoff:  retrytopic.Backoff{Initial: time.Millisecond, Max: time.Millisecond},
		KeyOrder: &retrytopic.KeyOrder{DB: db.Pool, Outbox: u.ob, ConsumerGroup: unitGroup, Table: u.table},
	}
	if mod != nil {
		mod(&cfg)
	}
	u.rt, err = retrytopic.New(cfg, nil)
	require.NoError(t, err)
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: unitGroup, Table: deduplicator.TableConfig{Schema: db.Schema}}, nil)
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	u.ps = gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	observe := func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			_, err := h(m)
			u.results <- err
			return nil, nil
		}
	}
	router.AddMiddleware(observe, u.rt.Middleware, dedup.Middleware, u.rt.ReleaseMiddleware)
	h := (&fixture{}).ledgerHandler(func(ev event, _ bool) error {
		u.mu.Lock()
		defer u.mu.Unlock()
		if u.fail[ev] > 0 {
			u.fail[ev]--
			return errDownstream
		}
		return nil
	})
	router.AddConsumerHandler("main", unitMain, u.ps, h)
	router.AddConsumerHandler("retry", unitRetry, u.ps, h)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(context.Background())
	}()
	t.Cleanup(func() {
		_ = router.Close()
		<-done
		_ = u.ps.Close()
	})
	<-router.Running()
	return u
}

// failNext makes ev's next n runs fail transiently.
func (u *unit) failNext(ev event, n int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.fail[ev] = n
}

// msg is an event message of key with a new UUIDv7 event id.
func (u *unit) msg(key string, n int) *message.Message { return (&fixture{}).msg(key, n) }

// deliver hands m to topic's handler and returns the chain's result.
func (u *unit) deliver(t *testing.T, topic string, m *message.Message) error {
	t.Helper()
	require.NoError(t, u.ps.Publish(topic, m.Copy()))
	select {
	case err := <-u.results:
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("message %s on %s: no result", m.UUID, topic)
		return nil
	}
}

// lastCopy returns the newest captured retry copy.
func (u *unit) lastCopy(t *testing.T) *message.Message {
	t.Helper()
	u.mu.Lock()
	defer u.mu.Unlock()
	require.NotEmpty(t, u.copies)
	return u.copies[len(u.copies)-1]
}

// handoffs returns the messages the hand-offs wrote to the outbox, oldest
// first.
func (u *unit) handoffs(t *testing.T) []*message.Message {
	t.Helper()
	rows, err := u.db.Pool.Query(context.Background(), `SELECT uuid, payload, metadata FROM `+u.ob.MessagesTable(unitRetry)+` ORDER BY "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var out []*message.Message
	for rows.Next() {
		var id string
		var payload, md []byte
		require.NoError(t, rows.Scan(&id, &payload, &md))
		m := message.NewMessage(id, payload)
		require.NoError(t, json.Unmarshal(md, &m.Metadata))
		out = append(out, m)
	}
	require.NoError(t, rows.Err())
	return out
}

// ids returns the event ids of msgs.
func ids(msgs ...*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.Metadata.Get(publisher.MetadataEventID)
	}
	return out
}

// parked returns the event ids parked for key, in order, and which of them
// has a copy on the retry path.
func (u *unit) parked(t *testing.T, key string) (events []string, withCopy []bool) {
	t.Helper()
	all, err := retrytopic.ListParked(context.Background(), u.db.Pool, u.table, unitGroup)
	require.NoError(t, err)
	for _, p := range all {
		if p.Key == key {
			events = append(events, p.EventID.String())
			withCopy = append(withCopy, p.Topic != "")
		}
	}
	return events, withCopy
}

func (u *unit) order(t *testing.T, key string) []int {
	return (&fixture{db: u.db}).order(t, key)
}

func (u *unit) eventID(m *message.Message) uuid.UUID {
	return uuid.MustParse(m.Metadata.Get(publisher.MetadataEventID))
}
