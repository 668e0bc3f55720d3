package deduplicator_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	for range 3 {
		require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
	}
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'processed_event'", db.Schema))
	require.Equal(t, 5, db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE component = $1", "processed_event:processed_event"))
	// The documented shape: primary key (event_id, consumer_group).
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
		WHERE c.relname = 'processed_event' AND c.relnamespace = $1::regnamespace AND i.indisprimary
		AND pg_get_indexdef(i.indexrelid) LIKE '%(event_id, consumer_group)%'`, db.Schema))
}

// Every instance of a service may call Migrate at start-up: concurrent calls
// are serialised and the schema is created once.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() { errs[i] = migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, 5, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
}

// Custom schema and table names, created if missing, quoted everywhere, and
// used by Claim; two tables in one schema keep separate migration records.
func TestMigrateCustomNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	schema := db.Schema + "_Dedup" // mixed case: only correct if quoted
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	orders := deduplicator.TableConfig{Schema: schema, Table: "Orders_seen"}
	refunds := deduplicator.TableConfig{Schema: schema, Table: "refunds_seen"}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(orders)))
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(refunds)))
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(orders)))

	require.Equal(t, 11, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", schema), "two tables, their _setting, _group, _lease and _progress, and the migration table")
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = 'Orders_seen_processed_at_non_v7_idx'", schema))
	require.Equal(t, 10, db.Count(t, "SELECT 1 FROM "+pgx.Identifier{schema, "idem_schema_migration"}.Sanitize()))

	d, err := deduplicator.New(deduplicator.Config{TableConfig: orders, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	id := publisher.NewEventID()
	inTx(t, db, func(tx pgx.Tx) {
		first, err := d.Claim(ctx, tx, id)
		require.NoError(t, err)
		require.True(t, first)
	})
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM "+pgx.Identifier{schema, "Orders_seen"}.Sanitize()))
	require.Zero(t, db.Count(t, "SELECT 1 FROM "+pgx.Identifier{schema, "refunds_seen"}.Sanitize()))
}

// Names that are not plain identifiers never reach SQL.
func TestMigrateRefusesInjection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	db.Exec(t, "CREATE TABLE victim (id int)")
	for _, tc := range []deduplicator.TableConfig{
		{Schema: db.Schema, Table: `x"; DROP TABLE victim; --`},
		{Schema: db.Schema + `"; DROP TABLE victim; --`},
		{Schema: db.Schema, Table: "x; DROP TABLE victim"},
		{Schema: db.Schema, Table: "a.b"},
		{Schema: db.Schema, Table: "täble"},
		{Schema: db.Schema, Table: strings.Repeat("t", 64)},
	} {
		require.Error(t, tc.Validate(), "%+v", tc)
		require.Error(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)), "%+v", tc)
		_, err := migrate.New(nil, deduplicator.MigrationLine(tc))
		require.Error(t, err, "%+v", tc)
	}
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "only victim exists")
}

// The rendered SQL is what goose or golang-migrate users apply: it creates
// and drops exactly the configured table.
func TestMigrationsRawSQLUpAndDown(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	migs := renderMigrations(t, deduplicator.TableConfig{Schema: db.Schema, Table: "seen"})
	require.NotEmpty(t, migs)
	require.Equal(t, 1, migs[0].Version)
	require.Contains(t, migs[0].Up, pgx.Identifier{db.Schema, "seen"}.Sanitize())

	for _, m := range migs {
		db.Exec(t, m.Up)
	}
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'seen'", db.Schema))
	// The SQL records its versions, so the start-up check passes and Migrate
	// finds nothing to do.
	require.NoError(t, deduplicator.Check(context.Background(), db.Pool, deduplicator.TableConfig{Schema: db.Schema, Table: "seen"}))
	require.Equal(t, len(migs), db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE component = 'processed_event:seen'"))
	for i := len(migs) - 1; i >= 0; i-- {
		db.Exec(t, migs[i].Down)
	}
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'seen'", db.Schema))
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
}

// versionsOf lists "component version" for each applied or reverted version.
func versionsOf(res *migrate.MigrateResult) []string {
	out := []string{}
	for _, v := range res.Versions {
		out = append(out, fmt.Sprintf("%s %d_%s", v.Component, v.Version, v.Name))
	}
	return out
}

func pendingOf(t *testing.T, m *migrate.Migrator) []int {
	t.Helper()
	res, err := m.Validate(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(res.Pending) == 0, res.OK)
	out := []int{}
	for _, p := range res.Pending {
		out = append(out, p.Version)
	}
	return out
}

// A Migrator returns what it applied, per component and version; Validate
// lists what is pending; down steps back one version by default, to a
// target version, or all the way (-1).
func TestMigratorUpValidateDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	table := deduplicator.TableConfig{Schema: db.Schema, Table: "seen"}
	m, err := migrate.New(db.Pool, deduplicator.MigrationLine(table))
	require.NoError(t, err)

	v, err := m.Validate(ctx)
	require.NoError(t, err)
	require.False(t, v.OK)
	require.Len(t, v.Pending, 5)
	require.Equal(t, "processed_event:seen", v.Pending[0].Component)
	require.Equal(t, renderMigrations(t, table), v.Pending, "pending migrations are rendered as Migrations renders them")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "Validate only reads")

	res, err := m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 1})
	require.NoError(t, err)
	require.Equal(t, migrate.DirectionUp, res.Direction)
	require.Equal(t, []string{"processed_event:seen 1_processed_event"}, versionsOf(res))
	require.Equal(t, []int{2, 3, 4, 5}, pendingOf(t, m))
	requireTableError(t, deduplicator.Check(ctx, db.Pool, table), migrate.ErrMigrationsPending, db.Schema+".seen")

	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"processed_event:seen 2_retention_and_groups", "processed_event:seen 3_lease", "processed_event:seen 4_processed_at_index_non_v7", "processed_event:seen 5_progress"}, versionsOf(res))
	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, res.Versions, "nothing left to apply")
	require.Empty(t, pendingOf(t, m))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, table))

	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, migrate.DirectionDown, res.Direction)
	require.Equal(t, []string{"processed_event:seen 5_progress"}, versionsOf(res), "one step by default")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'seen_progress'", db.Schema))
	require.Equal(t, []int{5}, pendingOf(t, m))
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"processed_event:seen 4_processed_at_index_non_v7"}, versionsOf(res))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = 'seen_processed_at_idx'", db.Schema), "the full index is back")
	require.Equal(t, []int{4, 5}, pendingOf(t, m))

	_, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	res, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: 1})
	require.NoError(t, err)
	require.Equal(t, []string{"processed_event:seen 5_progress", "processed_event:seen 4_processed_at_index_non_v7", "processed_event:seen 3_lease", "processed_event:seen 2_retention_and_groups"}, versionsOf(res))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'seen_setting'", db.Schema))
	res, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: -1})
	require.NoError(t, err)
	require.Equal(t, []string{"processed_event:seen 1_processed_event"}, versionsOf(res))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "only idem_schema_migration is left")
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
	res, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: -1})
	require.NoError(t, err)
	require.Empty(t, res.Versions)

	_, err = m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 6})
	require.ErrorContains(t, err, "target version 6 is not a version of processed_event:seen")
	_, err = m.Migrate(ctx, "sideways", nil)
	require.ErrorContains(t, err, `direction "sideways"`)

	_, err = migrate.New(db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema, Table: "a;b"}))
	require.ErrorContains(t, err, "Table:")
}

// Down from the partitioned layout reverts version 100 first, keeping every
// row in a plain table; a Migrator of the plain layout refuses to go down
// past the version 100 it does not know.
func TestMigratorDownFromPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	part := deduplicator.TableConfig{Schema: db.Schema, Layout: deduplicator.LayoutPartitioned}
	plain := deduplicator.TableConfig{Schema: db.Schema}
	mp, err := migrate.New(db.Pool, deduplicator.MigrationLine(part))
	require.NoError(t, err)
	res, err := mp.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Equal(t, []string{
		"processed_event:processed_event 1_processed_event",
		"processed_event:processed_event 2_retention_and_groups",
		"processed_event:processed_event 3_lease",
		"processed_event:processed_event 4_processed_at_index_non_v7",
		"processed_event:processed_event 5_progress",
		"processed_event:processed_event 100_partition_by_event_id",
	}, versionsOf(res))
	db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'g')", publisher.NewEventID())

	m, err := migrate.New(db.Pool, deduplicator.MigrationLine(plain))
	require.NoError(t, err)
	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.ErrorIs(t, err, migrate.ErrUnknownVersion)
	require.Empty(t, res.Versions)

	res, err = mp.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"processed_event:processed_event 100_partition_by_event_id"}, versionsOf(res))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event"))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, plain))
}

// MigrateTx runs every version in a savepoint of the caller's transaction:
// nothing is kept unless the caller commits.
func TestMigratorMigrateTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	table := deduplicator.TableConfig{Schema: db.Schema}
	m, err := migrate.New(db.Pool, deduplicator.MigrationLine(table))
	require.NoError(t, err)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	res, err := m.MigrateTx(ctx, tx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 5)
	v, err := m.ValidateTx(ctx, tx)
	require.NoError(t, err)
	require.True(t, v.OK)
	require.NoError(t, deduplicator.Check(ctx, tx, table))
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, []int{1, 2, 3, 4, 5}, pendingOf(t, m), "rolled back with the caller's transaction")

	inTx(t, db, func(tx pgx.Tx) {
		res, err := m.MigrateTx(ctx, tx, migrate.DirectionUp, nil)
		require.NoError(t, err)
		require.Len(t, res.Versions, 5)
	})
	require.NoError(t, deduplicator.Check(ctx, db.Pool, table))
}

// renderMigrations is the SQL a migrate.Migrator renders for cfg's line.
func renderMigrations(t *testing.T, cfg deduplicator.TableConfig) []migrate.Migration {
	t.Helper()
	m, err := migrate.New(nil, deduplicator.MigrationLine(cfg))
	require.NoError(t, err)
	migs, err := m.Migrations()
	require.NoError(t, err)
	return migs
}
