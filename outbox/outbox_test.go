package outbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

var _ idem.OutboxWriter = (*outbox.Outbox)(nil)

func TestRollbackNoRowNoMessage_CommitExactlyOneMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "commit", 2)
	e.db.Exec(t, `CREATE TABLE orders (id text PRIMARY KEY)`)

	// Rolled back: neither the business row nor the event exists.
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO orders VALUES ('order-rolled-back')`)
	require.NoError(t, err)
	require.NoError(t, e.outbox.Publisher(tx).Publish(topic, event("order-rolled-back", 0)))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topic)))

	// Committed: one row, one record.
	tx, err = e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO orders VALUES ('order-1')`)
	require.NoError(t, err)
	msg := event("order-1", 0)
	callerUUID := msg.UUID
	require.NoError(t, e.outbox.Publisher(tx).Publish(topic, msg))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topic)))

	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	recs := consume(t, e.broker.Addrs, topic, 1)
	require.Len(t, recs, 1)
	r := recs[0]
	require.Equal(t, "order-1", r.Key, "record key = aggregate id")
	id, err := publisher.ParseEventID(r.Headers[publisher.MetadataEventID])
	require.NoError(t, err, "event_id header must be a UUIDv7")
	require.Equal(t, msg.Metadata.Get(publisher.MetadataEventID), id.String())
	require.Equal(t, callerUUID, msg.UUID, "the caller's msg.UUID is kept")
	require.NotEmpty(t, r.Headers[publisher.MetadataOccurredAt])
	require.JSONEq(t, `{"aggregate":"order-1","seq":0}`, r.Value)

	// The forwarder keeps polling and nothing else appears.
	waitPolls(t, f, 3)
	require.EqualValues(t, 1, highWater(t, e.broker.Addrs, topic))
	require.EqualValues(t, 1, f.Stats().Forwarded)
}

func TestPublishToUnmigratedTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	err = e.outbox.Publisher(tx).Publish("never-migrated", event("a", 0))
	require.ErrorIs(t, err, outbox.ErrTopicNotMigrated)

	err = e.outbox.PoolPublisher(e.db.Pool).Publish("bad topic!", event("a", 0))
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)
}

func TestInvalidEventIDWritesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0, "orders")
	good := event("a", 0)
	bad := event("a", 1)
	bad.Metadata.Set(publisher.MetadataEventID, "not-a-uuid")
	err := e.outbox.PoolPublisher(e.db.Pool).Publish("orders", good, bad)
	require.ErrorIs(t, err, publisher.ErrInvalidEventID)
	require.True(t, idem.IsPermanent(err))
	require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable("orders")))
}

func TestPoolPublisherAndRowLayout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0, "orders")
	msgs := []*message.Message{event("a", 0), event("a", 1), event("b", 0)}
	require.NoError(t, e.outbox.PoolPublisher(e.db.Pool).Publish("orders", msgs...))
	rows, err := e.db.Pool.Query(context.Background(), `SELECT uuid, metadata->>'event_id', metadata->>'partition_key' FROM `+e.outbox.MessagesTable("orders")+` ORDER BY transaction_id, "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	i := 0
	for rows.Next() {
		var u, id, key string
		require.NoError(t, rows.Scan(&u, &id, &key))
		require.Equal(t, msgs[i].UUID, u)
		require.Equal(t, msgs[i].Metadata.Get(publisher.MetadataEventID), id)
		require.Equal(t, msgs[i].Metadata.Get(publisher.MetadataPartitionKey), key)
		i++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, 3, i)
}

func TestPublisherFromContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0, "orders")

	_, err := e.outbox.PublisherFromContext(ctx)
	require.ErrorIs(t, err, idem.ErrNotInHandler)

	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	incoming := publisher.NewEventID()
	hctx := idemctx.With(ctx, &idemctx.Value{Tx: tx, EventID: incoming, ConsumerGroup: "g", CorrelationID: "corr-1"})
	pub, err := e.outbox.PublisherFromContext(hctx)
	require.NoError(t, err)
	msg := event("a", 0)
	require.NoError(t, pub.Publish("orders", msg))
	require.Equal(t, incoming.String(), msg.Metadata.Get(publisher.MetadataCausationID))
	require.Equal(t, "corr-1", msg.Metadata.Get(publisher.MetadataCorrelationID))
	// Not visible outside the transaction until it commits.
	require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable("orders")))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable("orders")+` WHERE metadata->>'causation_id' = $1`, incoming.String()))
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := outbox.New(outbox.Config{Schema: "bad schema"}, nil)
	require.ErrorContains(t, err, "Schema")
	_, err = outbox.New(outbox.Config{PayloadType: "TEXT"}, nil)
	require.ErrorContains(t, err, "PayloadType")
	_, err = outbox.New(outbox.Config{Topics: []string{"x;drop"}}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)
	long := uuid.NewString() + uuid.NewString()
	_, err = outbox.New(outbox.Config{Topics: []string{long}}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)

	o, err := outbox.New(outbox.Config{}, watermill.NopLogger{})
	require.NoError(t, err)
	require.Equal(t, `"public"."outbox_orders"`, o.MessagesTable("orders"))
	_, err = outbox.NewForwarder(outbox.ForwarderConfig{Outbox: o}, nil)
	require.ErrorContains(t, err, "DB: required")
}
