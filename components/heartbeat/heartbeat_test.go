package heartbeat_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/heartbeat"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/heartbeatsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A running heartbeat writes the middleware's counters, consumer group and
// mode as they change, and stops with its context.
func TestRunWritesTheCounters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 3)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table), heartbeat.MigrationLine(db.Schema)))
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)
	hb, err := heartbeat.New(heartbeat.Config{DB: db.Pool, Schema: db.Schema, Dedup: d, Instance: "billing-1",
		Version: "v1.2.3", Interval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- hb.Run(runCtx) }()

	h := d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	id := publisher.NewEventID().String()
	for range 2 { // processed, then a duplicate
		m := message.NewMessage("m", []byte(`{}`))
		m.Metadata.Set(publisher.MetadataEventID, id)
		_, err := h(m)
		require.NoError(t, err)
	}
	_, err = h(message.NewMessage("m", []byte(`{}`))) // rejected: no event id
	require.Error(t, err)

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		is, err := heartbeatsql.Instances(ctx, db.Pool, db.Schema, time.Hour)
		require.NoError(c, err)
		require.Len(c, is, 1)
		require.Equal(c, heartbeatsql.Sample{Instance: "billing-1", ConsumerGroup: "billing", Mode: "transaction",
			Version: "v1.2.3", Processed: 1, Duplicates: 1, Rejected: 1}, zeroTimes(is[0].Sample))
	}, 30*time.Second, 20*time.Millisecond)
	stop()
	require.NoError(t, <-done)
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(DISTINCT started_at) FROM idem_heartbeat`).Scan(&n))
	require.Equal(t, 1, n, "one run")
}

func zeroTimes(s heartbeatsql.Sample) heartbeatsql.Sample {
	s.StartedAt, s.At = time.Time{}, time.Time{}
	return s
}

// Invalid configs are refused by field.
func TestNewRefuses(t *testing.T) {
	t.Parallel()
	_, err := heartbeat.New(heartbeat.Config{}, nil)
	require.ErrorContains(t, err, "DB: required")
	line := heartbeat.MigrationLine(`bad"schema`)
	require.Error(t, line.Err)
}

// With an Outbox, each sample carries its topics' pending rows.
func TestRunReportsTheOutboxBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 3)
	table := deduplicator.TableConfig{Schema: db.Schema}
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"billing.charged", "billing.refunded"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table), heartbeat.MigrationLine(db.Schema),
		outbox.MigrationLine(ob.Config(), "billing.charged"), outbox.MigrationLine(ob.Config(), "billing.refunded")))
	for i, topic := range []string{"billing.charged", "billing.charged", "billing.refunded"} {
		require.NoError(t, ob.PoolPublisher(db.Pool).Publish(topic, message.NewMessage(fmt.Sprint(i), []byte(`{}`))))
	}
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)
	hb, err := heartbeat.New(heartbeat.Config{DB: db.Pool, Schema: db.Schema, Dedup: d, Instance: "billing-1",
		Interval: 20 * time.Millisecond, Outbox: ob}, nil)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- hb.Run(runCtx) }()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		is, err := heartbeatsql.Instances(ctx, db.Pool, db.Schema, time.Hour)
		require.NoError(c, err)
		require.Len(c, is, 1)
		require.NotNil(c, is[0].OutboxBacklog)
		require.EqualValues(c, 3, *is[0].OutboxBacklog)
	}, 30*time.Second, 20*time.Millisecond)
	stop()
	require.NoError(t, <-done)
}
