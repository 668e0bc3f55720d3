package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

func versionsOf(res *migrate.MigrateResult) []string {
	out := []string{}
	for _, v := range res.Versions {
		out = append(out, fmt.Sprintf("%s %d_%s", v.Component, v.Version, v.Name))
	}
	return out
}

func pendingOf(t *testing.T, m *migrate.Migrator) []string {
	t.Helper()
	res, err := m.Validate(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(res.Pending) == 0, res.OK)
	out := []string{}
	for _, p := range res.Pending {
		out = append(out, fmt.Sprintf("%s %d", p.Component, p.Version))
	}
	return out
}

// A Migrator records each topic's tables as its own component; Validate
// lists what is pending, Check and the forwarder refuse it; down steps back
// one version of every topic by default.
func TestMigrator_UpValidateDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{"orders", "orders.v2"}}
	ob, err := outbox.New(cfg, nil)
	require.NoError(t, err)
	m, err := newMigrator(db.Pool, cfg)
	require.NoError(t, err)

	require.Equal(t, []string{"outbox:outbox_orders 1", "outbox:outbox_orders 2", "outbox:outbox_orders 3", "outbox:outbox_orders 4", "outbox:outbox_orders 5", "outbox:outbox_orders.v2 1", "outbox:outbox_orders.v2 2", "outbox:outbox_orders.v2 3", "outbox:outbox_orders.v2 4", "outbox:outbox_orders.v2 5"}, pendingOf(t, m))
	migs, err := rendered(lines(cfg)...)
	require.NoError(t, err)
	v, err := m.Validate(ctx)
	require.NoError(t, err)
	require.Equal(t, migs, v.Pending, "pending migrations are rendered as Migrations renders them")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "Validate only reads")

	res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Equal(t, migrate.DirectionUp, res.Direction)
	require.Equal(t, []string{"outbox:outbox_orders 1_topic_tables", "outbox:outbox_orders 2_snapshot_position", "outbox:outbox_orders 3_position_cluster", "outbox:outbox_orders 4_dead_rows", "outbox:outbox_orders 5_created_at_utc",
		"outbox:outbox_orders.v2 1_topic_tables", "outbox:outbox_orders.v2 2_snapshot_position", "outbox:outbox_orders.v2 3_position_cluster", "outbox:outbox_orders.v2 4_dead_rows", "outbox:outbox_orders.v2 5_created_at_utc"}, versionsOf(res))
	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, res.Versions)
	require.Empty(t, pendingOf(t, m))
	require.NoError(t, ob.Check(ctx, db.Pool))

	// The record is what Check reads: without it the tables are pending.
	db.Exec(t, "DELETE FROM idem_schema_migration WHERE component = 'outbox:outbox_orders.v2'")
	terr := requireOutboxTableError(t, ob.Check(ctx, db.Pool), migrate.ErrMigrationsPending, "orders.v2", ob.MessagesTable("orders.v2"))
	require.Contains(t, terr.Problem, "outbox:outbox_orders.v2")
	_, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Publisher: refusingPublisher{t}}, nil)
	requireOutboxTableError(t, err, migrate.ErrMigrationsPending, "orders.v2", ob.MessagesTable("orders.v2"))
	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"outbox:outbox_orders.v2 1_topic_tables", "outbox:outbox_orders.v2 2_snapshot_position", "outbox:outbox_orders.v2 3_position_cluster", "outbox:outbox_orders.v2 4_dead_rows", "outbox:outbox_orders.v2 5_created_at_utc"}, versionsOf(res), "existing tables of the right shape are recorded")

	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"outbox:outbox_orders.v2 5_created_at_utc", "outbox:outbox_orders 5_created_at_utc"}, versionsOf(res), "backwards, one version per topic")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND column_name = 'created_at' AND column_default = 'CURRENT_TIMESTAMP'", db.Schema), "version 5 reverted")
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"outbox:outbox_orders.v2 4_dead_rows", "outbox:outbox_orders 4_dead_rows"}, versionsOf(res))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name LIKE '%\\_\\_dead'", db.Schema), "version 4 reverted")
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"outbox:outbox_orders.v2 3_position_cluster", "outbox:outbox_orders 3_position_cluster"}, versionsOf(res))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND column_name LIKE 'position_%' AND column_name <> 'position_snapshot'", db.Schema), "version 3 reverted")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND column_name = 'position_snapshot'", db.Schema), "version 2 kept")
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, migrate.DirectionDown, res.Direction)
	require.Equal(t, []string{"outbox:outbox_orders.v2 2_snapshot_position", "outbox:outbox_orders 2_snapshot_position"}, versionsOf(res))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND column_name LIKE '%snapshot'", db.Schema), "version 2 reverted")
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_trigger WHERE tgname = 'idem_outbox_notify' AND tgrelid = to_regclass($1)", ob.MessagesTable("orders")))
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"outbox:outbox_orders.v2 1_topic_tables", "outbox:outbox_orders 1_topic_tables"}, versionsOf(res))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "only idem_schema_migration is left")
	requireOutboxTableError(t, ob.Check(ctx, db.Pool), outbox.ErrTopicNotMigrated, "orders", ob.MessagesTable("orders"))
	res, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: -1})
	require.NoError(t, err)
	require.Empty(t, res.Versions)

	_, err = m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 6})
	require.ErrorContains(t, err, "target version 6 is not a version of outbox:outbox_orders")
	_, err = newMigrator(db.Pool, outbox.Config{Topics: []string{"bad;topic"}})
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)
}

// Tables watermill-sql created itself (its CREATE TABLE IF NOT EXISTS),
// without a version, are adopted as version 1 with their rows,
// by exactly one of several instances migrating at once.
func TestMigrator_AdoptsUnversionedTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}
	ob, err := outbox.New(cfg, nil)
	require.NoError(t, err)
	// What watermill-sql creates, without a version.
	q, err := schemaAdapter(ob).SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: "orders"})
	require.NoError(t, err)
	q2, err := offsetsAdapter(ob).SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: "orders"})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, q := range append(q, q2...) {
			if _, err := tx.Exec(ctx, q.Query, q.Args...); err != nil {
				return err
			}
		}
		return nil
	}))
	e := &env{db: db, outbox: ob}
	e.publishTx(t, "orders", event("a", 0), event("a", 1))
	requireOutboxTableError(t, ob.Check(ctx, db.Pool), migrate.ErrMigrationsPending, "orders", ob.MessagesTable("orders"))

	m, err := newMigrator(db.Pool, cfg)
	require.NoError(t, err)
	results := make([]*migrate.MigrateResult, 4)
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() { results[i], errs[i] = m.Migrate(ctx, migrate.DirectionUp, nil) })
	}
	wg.Wait()
	var applied []string
	for i := range results {
		require.NoError(t, errs[i])
		applied = append(applied, versionsOf(results[i])...)
	}
	// Each version runs in its own transaction: concurrent callers may
	// share the work, but none applies a version twice.
	slices.Sort(applied)
	require.Equal(t, []string{"outbox:outbox_orders 1_topic_tables", "outbox:outbox_orders 2_snapshot_position", "outbox:outbox_orders 3_position_cluster", "outbox:outbox_orders 4_dead_rows", "outbox:outbox_orders 5_created_at_utc"}, applied, "adopted once")
	require.NoError(t, ob.Check(ctx, db.Pool))
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM "+ob.MessagesTable("orders")), "rows kept")
}

// MigrateTx runs on the caller's transaction: nothing is kept unless it
// commits.
func TestMigrator_MigrateTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}
	m, err := newMigrator(db.Pool, cfg)
	require.NoError(t, err)
	ob, err := outbox.New(cfg, nil)
	require.NoError(t, err)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	res, err := m.MigrateTx(ctx, tx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 5)
	v, err := m.ValidateTx(ctx, tx)
	require.NoError(t, err)
	require.True(t, v.OK)
	require.NoError(t, ob.Check(ctx, tx))
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, []string{"outbox:outbox_orders 1", "outbox:outbox_orders 2", "outbox:outbox_orders 3", "outbox:outbox_orders 4", "outbox:outbox_orders 5"}, pendingOf(t, m))

	require.NoError(t, pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := m.MigrateTx(ctx, tx, migrate.DirectionUp, nil)
		return err
	}))
	require.NoError(t, ob.Check(ctx, db.Pool))
}
