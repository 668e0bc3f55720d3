package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Status lists each topic's versions applied or pending; RecordedTopics
// (idemctl's topics when --topics is not given) finds the topics a
// Migrator of the schema and prefix has migrated.
func TestMigrator_StatusAndRecordedTopics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{"orders", "orders.v2"}}
	recorded := func(cfg outbox.Config) ([]string, error) {
		ob, err := outbox.New(cfg, nil)
		require.NoError(t, err)
		return outboxsql.RecordedTopics(ctx, db.Pool, ob.Config().Schema, ob.Config().TablePrefix)
	}

	topics, err := recorded(cfg)
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

	topics, err = recorded(cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"orders"}, topics)
	topics, err = recorded(outbox.Config{Schema: db.Schema, TablePrefix: "ob_"})
	require.NoError(t, err)
	require.Equal(t, []string{"payments"}, topics)
	_, err = outboxsql.RecordedTopics(ctx, db.Pool, "bad schema", "outbox_")
	require.Error(t, err)
	// A recorded component whose topic no table name can hold is skipped.
	db.Exec(t, "INSERT INTO idem_schema_migration (component, version, name) VALUES ($1, 1, 'topic_tables')", "outbox:outbox_"+strings.Repeat("x", 60))
	topics, err = recorded(cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"orders"}, topics)
}
