package deduplicator_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The reference document's DDL (R-KFK-IDEM-2): the key is the event alone.
const referenceDDL = `
CREATE TABLE processed_event (
    event_id       uuid        PRIMARY KEY,
    consumer_group text        NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_processed_event_processed_at ON processed_event (processed_at);`

// The reference document's TTL variant: partitions on processed_at, which
// must then be part of the key. A DEFAULT partition takes today's claims.
const referencePartitionedDDL = `
CREATE TABLE processed_event (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, processed_at)
) PARTITION BY RANGE (processed_at);
CREATE TABLE processed_event_2026_06 PARTITION OF processed_event FOR VALUES FROM ('2026-06-01') TO ('2026-07-01');
CREATE TABLE processed_event_2026_07 PARTITION OF processed_event FOR VALUES FROM ('2026-07-01') TO ('2026-08-01');
CREATE TABLE processed_event_default PARTITION OF processed_event DEFAULT;`

// requireTableError asserts err is a *TableError for schema.table with the
// reason, and that its one-line message names the problem and a fix.
func requireTableError(t *testing.T, err error, reason error, table string) *migrate.TableError {
	t.Helper()
	require.ErrorIs(t, err, reason)
	var terr *migrate.TableError
	require.ErrorAs(t, err, &terr)
	require.Equal(t, table, terr.Table)
	require.NotEmpty(t, terr.Problem)
	require.NotEmpty(t, terr.Fix)
	require.NotContains(t, err.Error(), "\n")
	require.Contains(t, err.Error(), table)
	require.Contains(t, err.Error(), terr.Problem)
	require.Contains(t, err.Error(), "fix: "+terr.Fix)
	for _, other := range []error{deduplicator.ErrTableMissing, deduplicator.ErrTableKey, deduplicator.ErrTableColumns, migrate.ErrMigrationsPending, deduplicator.ErrLayoutMismatch} {
		if other != reason {
			require.False(t, errors.Is(err, other), "%v is not %v", err, other)
		}
	}
	return terr
}

func TestCheck_MigratedTablesPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	for _, tc := range []deduplicator.TableConfig{
		{Schema: db.Schema},
		{Schema: db.Schema, Table: "Seen_Partitioned", Layout: deduplicator.LayoutPartitioned},
	} {
		require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
		require.NoError(t, deduplicator.Check(ctx, db.Pool, tc), "%+v", tc)
		inTx(t, db, func(tx pgx.Tx) { require.NoError(t, deduplicator.Check(ctx, tx, tc)) })
	}
}

func TestCheck_TableMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	err := deduplicator.Check(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema})
	terr := requireTableError(t, err, deduplicator.ErrTableMissing, db.Schema+".processed_event")
	require.Contains(t, terr.Fix, "deduplicator.MigrationLine")

	// A view of that name is not a table.
	db.Exec(t, "CREATE VIEW processed_event AS SELECT gen_random_uuid() AS event_id, 'g'::text AS consumer_group, now() AS processed_at")
	err = deduplicator.Check(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema})
	terr = requireTableError(t, err, deduplicator.ErrTableMissing, db.Schema+".processed_event")
	require.Contains(t, terr.Problem, "not a table")

	require.Error(t, deduplicator.Check(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema, Table: "a;b"}), "names are validated")
}

func TestCheck_ReferenceKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		ddl     string
		problem string
	}{
		"primary key event_id":        {referenceDDL, "primary key is (event_id), want (event_id, consumer_group): a second consumer group would skip"},
		"partitioned by processed_at": {referencePartitionedDDL, "partitioned by RANGE (processed_at)"},
		"no primary key":              {"CREATE TABLE processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now())", "has no primary key"},
		"key order":                   {"CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer_group, event_id))", "primary key is (consumer_group, event_id)"},
		"key with processed_at":       {"CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group, processed_at))", "its handler runs twice"},
		"deferrable key":              {"CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group) DEFERRABLE)", "DEFERRABLE"},
		"hash partitions on event_id": {"CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group)) PARTITION BY HASH (event_id)", "partitioned by HASH (event_id)"},
		// The reference's multi-group advice, applied while keeping a
		// unique event_id: ON CONFLICT DO NOTHING still skips on it.
		"extra unique key":     {referenceDDL + "; ALTER TABLE processed_event DROP CONSTRAINT processed_event_pkey, ADD PRIMARY KEY (event_id, consumer_group); CREATE UNIQUE INDEX one_row_per_event ON processed_event (event_id)", "unique index one_row_per_event on (event_id)"},
		"exclusion constraint": {"CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group), EXCLUDE USING btree (event_id WITH =))", "exclusion constraint"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t, 1)
			db.Exec(t, tc.ddl)
			err := deduplicator.Check(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema})
			terr := requireTableError(t, err, deduplicator.ErrTableKey, db.Schema+".processed_event")
			require.Contains(t, terr.Problem, tc.problem)
		})
	}
}

// Unique keys that contain the whole dedup key cannot make a claim skip:
// they are accepted, like any non-unique index and nullable extra columns.
func TestCheck_HarmlessExtras(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
	db.Exec(t, `CREATE UNIQUE INDEX wider ON processed_event (consumer_group, processed_at, event_id);
		CREATE INDEX by_group ON processed_event (consumer_group);
		ALTER TABLE processed_event ADD COLUMN note text, ADD COLUMN attempts int NOT NULL DEFAULT 1`)
	require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
}

func TestCheck_Columns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		alter   string
		problem string
	}{
		"no consumer_group":      {"ALTER TABLE processed_event DROP COLUMN consumer_group", "has no consumer_group column"},
		"varchar consumer_group": {"ALTER TABLE processed_event ALTER COLUMN consumer_group TYPE varchar(100)", "consumer_group is character varying(100), want text"},
		"timestamp":              {"ALTER TABLE processed_event ALTER COLUMN processed_at TYPE timestamp", "processed_at is timestamp without time zone"},
		"nullable processed_at":  {"ALTER TABLE processed_event ALTER COLUMN processed_at DROP NOT NULL", "processed_at is nullable"},
		"no default":             {"ALTER TABLE processed_event ALTER COLUMN processed_at DROP DEFAULT", "processed_at has no default"},
		"required extra column":  {"ALTER TABLE processed_event ADD COLUMN tenant text NOT NULL", "tenant is NOT NULL without a default"},
		"no processed_at":        {"ALTER TABLE processed_event DROP COLUMN processed_at", "has no processed_at column"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t, 1)
			tc0 := deduplicator.TableConfig{Schema: db.Schema}
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc0)))
			db.Exec(t, tc.alter)
			err := deduplicator.Check(ctx, db.Pool, tc0)
			terr := requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
			require.Contains(t, terr.Problem, tc.problem)
		})
	}
}

// A right table whose versions are not recorded (made by hand, or from SQL
// generated before Migrations recorded them), or a layout whose extra
// migrations did not run, is pending; the SQL of Migrations records itself;
// a layout that differs from the configuration is a mismatch.
func TestCheck_PendingAndLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	plain := deduplicator.TableConfig{Schema: db.Schema, Table: "seen"}
	part := deduplicator.TableConfig{Schema: db.Schema, Table: "seen", Layout: deduplicator.LayoutPartitioned}

	db.Exec(t, "CREATE TABLE seen (event_id uuid, consumer_group text, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group))")
	terr := requireTableError(t, deduplicator.Check(ctx, db.Pool, plain), migrate.ErrMigrationsPending, db.Schema+".seen")
	require.Contains(t, terr.Problem, "versions 1, 2, 3, 4, 5 of layout plain")

	migs := renderMigrations(t, plain)
	for _, m := range migs {
		db.Exec(t, m.Up) // as goose would
	}
	require.NoError(t, deduplicator.Check(ctx, db.Pool, plain))
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(plain)))
	terr = requireTableError(t, deduplicator.Check(ctx, db.Pool, part), migrate.ErrMigrationsPending, db.Schema+".seen")
	require.Contains(t, terr.Problem, "100")

	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(part)))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, part))
	terr = requireTableError(t, deduplicator.Check(ctx, db.Pool, plain), deduplicator.ErrLayoutMismatch, db.Schema+".seen")
	require.Contains(t, terr.Fix, "LayoutPartitioned")
	// Migrate with the other layout does not downgrade: it says so.
	requireTableError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(plain)), deduplicator.ErrLayoutMismatch, db.Schema+".seen")
}

// Migrate used to accept both reference tables (CREATE TABLE IF NOT EXISTS
// kept them) and record its versions. Now it refuses them before changing
// or recording anything.
func TestMigrate_RefusesReferenceTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, ddl := range map[string]string{"primary key event_id": referenceDDL, "partitioned by processed_at": referencePartitionedDDL} {
		for _, layout := range []deduplicator.Layout{deduplicator.LayoutPlain, deduplicator.LayoutPartitioned} {
			t.Run(name+"/"+layout.String(), func(t *testing.T) {
				t.Parallel()
				db := pgtest.New(t, 2)
				db.Exec(t, ddl)
				indexes := db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1", db.Schema)
				err := migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema, Layout: layout}))
				terr := requireTableError(t, err, deduplicator.ErrTableKey, db.Schema+".processed_event")
				require.Contains(t, terr.Fix, "ConvertTable")
				require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2", db.Schema, "idem_schema_migration"), "nothing recorded")
				require.Equal(t, indexes, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1", db.Schema), "nothing created")
			})
		}
	}
}

// claimRolledBack claims id for group in a transaction it rolls back, and
// reports whether the claim was first (the handler would run).
func claimRolledBack(t *testing.T, db *pgtest.DB, tc deduplicator.TableConfig, group string, id uuid.UUID) bool {
	t.Helper()
	ctx := context.Background()
	d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: group}, nil)
	require.NoError(t, err)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback(ctx)) }()
	first, err := d.Claim(ctx, tx, id)
	require.NoError(t, err)
	return first
}

// claimNoMatchingKey checks that a claim on a table whose key is not
// (event_id, consumer_group) fails with SQLSTATE 42P10 (no unique constraint
// matches the ON CONFLICT target), rather than skipping or re-running an
// event, even without Check.
func claimNoMatchingKey(t *testing.T, db *pgtest.DB, tc deduplicator.TableConfig, group string, id uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: group}, nil)
	require.NoError(t, err)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = d.Claim(ctx, tx, id)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "42P10", pgErr.Code)
}

func TestTableErrorMessage(t *testing.T) {
	t.Parallel()
	err := error(&migrate.TableError{Component: "deduplicator", Table: "public.processed_event", Problem: "primary key is (event_id)", Fix: "convert it", Err: deduplicator.ErrTableKey})
	require.Equal(t, "deduplicator: table public.processed_event: primary key is (event_id); fix: convert it", err.Error())
	require.True(t, errors.Is(err, deduplicator.ErrTableKey))
	require.True(t, strings.HasPrefix(deduplicator.ErrTableKey.Error(), "deduplicator: "))
}

// A service role that may claim but not read the migration table gets an
// error that says which GRANT is missing, with the server's SQLSTATE.
func TestCheck_MigrationTableNotReadable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
	role := db.Schema + "_svc"
	db.Exec(t, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" NOLOGIN")
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.Pool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	db.Exec(t, "GRANT USAGE ON SCHEMA "+pgx.Identifier{db.Schema}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize())
	db.Exec(t, "GRANT SELECT, INSERT ON processed_event TO "+pgx.Identifier{role}.Sanitize())

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	err = deduplicator.Check(ctx, tx, tc)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.InsufficientPrivilege, pgErr.Code)
	require.ErrorContains(t, err, "GRANT SELECT")
}
