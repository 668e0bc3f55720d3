package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Status lists each topic's versions applied or pending; RecordedTopics
// finds the topics a Migrator of the schema and prefix has migrated.
func TestMigrator_StatusAndRecordedTopics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{"orders", "orders.v2"}}

	topics, err := outbox.RecordedTopics(ctx, db.Pool, cfg)
	require.NoError(t, err)
	require.Empty(t, topics, "no migration table yet")

	m, err := newMigrator(db.Pool, cfg)
	require.NoError(t, err)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, []migrate.MigrationStatus{
		{Component: "outbox:outbox_orders", Version: 1, Name: "topic_tables"},
		{Component: "outbox:outbox_orders", Version: 2, Name: "snapshot_position"},
		{Component: "outbox:outbox_orders", Version: 3, Name: "position_cluster"},
		{Component: "outbox:outbox_orders", Version: 4, Name: "dead_rows"},
		{Component: "outbox:outbox_orders", Version: 5, Name: "created_at_utc"},
		{Component: "outbox:outbox_orders.v2", Version: 1, Name: "topic_tables"},
		{Component: "outbox:outbox_orders.v2", Version: 2, Name: "snapshot_position"},
		{Component: "outbox:outbox_orders.v2", Version: 3, Name: "position_cluster"},
		{Component: "outbox:outbox_orders.v2", Version: 4, Name: "dead_rows"},
		{Component: "outbox:outbox_orders.v2", Version: 5, Name: "created_at_utc"},
	}, st)

	one, err := newMigrator(db.Pool, outbox.Config{Schema: db.Schema, Topics: []string{"orders"}})
	require.NoError(t, err)
	_, err = one.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	// Another prefix and the dedup table share the migration table.
	other, err := outbox.New(outbox.Config{Schema: db.Schema, TablePrefix: "ob_", Topics: []string{"payments"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(other.Config(), "payments")))
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))

	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.Len(t, st, 10)
	require.True(t, st[0].Applied)
	require.True(t, st[1].Applied)
	require.True(t, st[2].Applied)
	require.True(t, st[3].Applied)
	require.True(t, st[4].Applied)
	require.WithinDuration(t, time.Now(), st[0].AppliedAt, time.Hour)
	require.False(t, st[5].Applied)

	topics, err = outbox.RecordedTopics(ctx, db.Pool, cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"orders"}, topics)
	topics, err = outbox.RecordedTopics(ctx, db.Pool, outbox.Config{Schema: db.Schema, TablePrefix: "ob_"})
	require.NoError(t, err)
	require.Equal(t, []string{"payments"}, topics)
	_, err = outbox.RecordedTopics(ctx, db.Pool, outbox.Config{Schema: "bad schema"})
	require.Error(t, err)
}
