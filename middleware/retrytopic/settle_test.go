package retrytopic_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A follower's copy is due at once (its key's first event is done), and the
// park transaction commits its row only after the publish: the copy can be
// consumed while the row is still uncommitted. It then finds its key free
// and runs; the middleware must wait for the park to commit and release the
// row, or the key stays parked behind an event that is done and every later
// event of the key follows it for good. (Found by the chaos soak's
// retry-topic leg: docs/soak.md.)
func TestKeyOrderCopyConsumedBeforeItsParkCommits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	table := retrytopic.ParkedKeysTable{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, retrytopic.MigrationLine(table)))
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{}, logger)
	const group, retryTopic, key = "billing", "orders.retry", "acct-1"
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{retryTopic}}, logger)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), retryTopic)))
	rt, err := retrytopic.New(retrytopic.Config{
		Publisher: ps, Topics: []string{retryTopic}, PoisonTopic: "orders.poison",
		KeyOrder: &retrytopic.KeyOrder{DB: db.Pool, Outbox: ob, ConsumerGroup: group, Table: table},
	}, logger)
	require.NoError(t, err)
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: group, Table: deduplicator.TableConfig{Schema: db.Schema}}, logger)
	require.NoError(t, err)

	ran := make(chan struct{}, 1)
	acked := make(chan error, 1)
	observe := func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			acked <- err
			return out, err
		}
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	router.AddMiddleware(observe, rt.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
	router.AddConsumerHandler("charge-retry", retryTopic, ps, func(*message.Message) error {
		ran <- struct{}{}
		return nil
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(context.Background())
	}()
	t.Cleanup(func() {
		_ = router.Close()
		<-done
		_ = ps.Close()
	})
	<-router.Running()

	// The follower's park transaction, between its publish and its COMMIT.
	id := publisher.NewEventID()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{db.Schema, "retry_parked_key"}.Sanitize()+
		` (consumer_group, partition_key, event_id, topic, not_before) VALUES ($1, $2, $3, $4, now())`, group, key, id, retryTopic)
	require.NoError(t, err)
	cp := message.NewMessage(uuid.NewString(), []byte(`{}`))
	cp.Metadata.Set(publisher.MetadataEventID, id.String())
	publisher.WithPartitionKey(cp, key)
	cp.Metadata.Set(retrytopic.MetadataAttempt, "0")
	cp.Metadata.Set(retrytopic.MetadataNotBefore, time.Now().Add(-time.Second).UTC().Format(time.RFC3339Nano))
	cp.Metadata.Set(retrytopic.MetadataOriginalTopic, "orders")
	require.NoError(t, ps.Publish(retryTopic, cp))

	select {
	case <-ran: // the key looked free: the copy ran
	case <-time.After(30 * time.Second):
		t.Fatal("the copy did not run")
	}
	select {
	case err := <-acked:
		t.Fatalf("acked (%v) while the transaction parking it is open: its row will stay", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, tx.Commit(ctx))
	select {
	case err := <-acked:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("not acked after the park committed")
	}
	parked, err := retrytopic.ListParked(ctx, db.Pool, table, group)
	require.NoError(t, err)
	require.Empty(t, parked, "the row the park committed was released")
	require.EqualValues(t, 1, rt.Stats().Released)
	require.EqualValues(t, 1, rt.Stats().Recovered)
}
