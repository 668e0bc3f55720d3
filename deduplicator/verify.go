package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Check verifies the live table described by cfg before claims rely on it:
//
//   - it exists;
//   - its columns are event_id uuid NOT NULL, consumer_group text NOT NULL
//     and processed_at timestamptz NOT NULL with a default; other columns
//     must be nullable or have a default (claims insert only the first two);
//   - its primary key is exactly (event_id, consumer_group), in that order,
//     not deferrable, and no other unique key or exclusion constraint could
//     make a claim conflict on fewer columns (ON CONFLICT DO NOTHING skips on
//     any of them);
//   - if partitioned, it is RANGE-partitioned on event_id alone;
//   - every migration of cfg's layout is recorded as applied;
//   - its layout (partitioned or not) is cfg.Layout.
//
// It only reads the catalogs, so it may run at every start-up; db is a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. A table that fails returns a
// [*migrate.TableError]; a failing query returns its error, wrapped.
func Check(ctx context.Context, db migrate.DBTX, cfg TableConfig) error {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	migs, err := loadMigrations(cfg)
	if err != nil {
		return err
	}
	return check(ctx, db, cfg, migs)
}

func check(ctx context.Context, db migrate.DBTX, cfg TableConfig, migs []migtable.Version) error {
	shape, err := inspectTable(ctx, db, cfg.Schema, cfg.Table)
	if err != nil {
		return err
	}
	if terr := shape.problem(cfg); terr != nil {
		return terr
	}
	pending, err := pendingVersions(ctx, db, cfg, migs)
	if err != nil {
		return err
	}
	if len(pending) > 0 {
		return &migrate.TableError{Component: "deduplicator",
			Table:   cfg.Schema + "." + cfg.Table,
			Problem: fmt.Sprintf("migration versions %s of layout %s are not recorded in %s.%s", joinVersions(pending), cfg.Layout, cfg.Schema, migtable.Table),
			Fix:     "migrate deduplicator.MigrationLine(cfg) up at start-up (a migrate.Migrator, or its rendered Migrations in your migration tool)",
			Err:     migrate.ErrMigrationsPending,
		}
	}
	if shape.partitioned != (cfg.Layout == LayoutPartitioned) {
		terr := &migrate.TableError{Component: "deduplicator", Table: cfg.Schema + "." + cfg.Table, Err: ErrLayoutMismatch}
		if shape.partitioned {
			terr.Problem = "the table is partitioned on event_id but TableConfig.Layout is LayoutPlain"
			terr.Fix = "set TableConfig.Layout to LayoutPartitioned in every component that names this table"
		} else {
			terr.Problem = "the table is plain but TableConfig.Layout is LayoutPartitioned and its migrations are recorded as applied"
			terr.Fix = "set TableConfig.Layout to LayoutPlain, or delete the stale version 100+ rows of " + componentKey(cfg) + " from " + migtable.Table + " and migrate up again"
		}
		return terr
	}
	return nil
}

// checkBeforeMigrate refuses an existing table that the migrations would
// leave as it is although claims cannot rely on it (wrong key, wrong
// partitioning, wrong columns). A missing table is fine: the migration creates it.
func checkBeforeMigrate(ctx context.Context, db migrate.DBTX, cfg TableConfig) error {
	shape, err := inspectTable(ctx, db, cfg.Schema, cfg.Table)
	if err != nil || !shape.exists {
		return err
	}
	if terr := shape.problem(cfg); terr != nil {
		return terr
	}
	return nil
}

// tableShape is what the catalogs say about a table.
type tableShape struct {
	exists      bool
	oid         uint32
	kind        string // pg_class.relkind
	partitioned bool
	partKey     string // pg_get_partkeydef, e.g. "RANGE (processed_at)"
	partOnID    bool   // RANGE on the event_id column alone
	columns     []tableColumn
	keys        []tableKey // unique indexes and exclusion constraints, primary key first
}

type tableColumn struct {
	name, typ           string // typ as format_type prints it
	notNull, hasDefault bool   // hasDefault: a default, identity or generated
}

type tableKey struct {
	index      string   // the index's name
	constraint string   // the constraint it backs, if any
	columns    []string // key columns in order; "" for an expression
	primary    bool
	exclusion  bool
	deferrable bool
}

// Columns of the processed_event table, and their types as format_type
// prints them.
var wantColumns = []tableColumn{
	{name: "event_id", typ: "uuid", notNull: true},
	{name: "consumer_group", typ: "text", notNull: true},
	{name: "processed_at", typ: "timestamp with time zone", notNull: true, hasDefault: true},
}

// inspectTable reads schema.table's kind, partition key, columns and unique
// keys from the catalogs; names travel as parameters.
func inspectTable(ctx context.Context, db migrate.DBTX, schema, table string) (tableShape, error) {
	var s tableShape
	wrap := func(err error) (tableShape, error) {
		return s, fmt.Errorf("deduplicator: inspect table %s.%s: %w", schema, table, err)
	}
	err := db.QueryRow(ctx, `SELECT c.oid, c.relkind::text, COALESCE(pg_get_partkeydef(c.oid), ''),
	COALESCE(pt.partstrat = 'r' AND pt.partnatts = 1 AND pt.partattrs[0] = (
		SELECT a.attnum FROM pg_catalog.pg_attribute a
		 WHERE a.attrelid = c.oid AND a.attname = 'event_id' AND NOT a.attisdropped), false)
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_partitioned_table pt ON pt.partrelid = c.oid
WHERE n.nspname = $1 AND c.relname = $2`, schema, table).Scan(&s.oid, &s.kind, &s.partKey, &s.partOnID)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return wrap(err)
	}
	s.exists = true
	s.partitioned = s.kind == "p"
	if s.kind != "r" && s.kind != "p" {
		return s, nil
	}

	rows, err := db.Query(ctx, `SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
	a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> ''
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum`, s.oid)
	if err != nil {
		return wrap(err)
	}
	s.columns, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (tableColumn, error) {
		var c tableColumn
		err := r.Scan(&c.name, &c.typ, &c.notNull, &c.hasDefault)
		return c, err
	})
	if err != nil {
		return wrap(err)
	}

	rows, err = db.Query(ctx, `SELECT ic.relname::text, COALESCE(con.conname::text, ''), i.indisprimary, i.indisexclusion,
	NOT i.indimmediate,
	ARRAY(SELECT COALESCE(a.attname::text, '')
	        FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n)
	        LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
	       WHERE k.n <= i.indnkeyatts
	       ORDER BY k.n)
FROM pg_catalog.pg_index i
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
LEFT JOIN pg_catalog.pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
WHERE i.indrelid = $1::oid AND (i.indisunique OR i.indisexclusion)
ORDER BY i.indisprimary DESC, 1`, s.oid)
	if err != nil {
		return wrap(err)
	}
	s.keys, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (tableKey, error) {
		var k tableKey
		err := r.Scan(&k.index, &k.constraint, &k.primary, &k.exclusion, &k.deferrable, &k.columns)
		return k, err
	})
	if err != nil {
		return wrap(err)
	}
	return s, nil
}

func (s tableShape) column(name string) (tableColumn, bool) {
	i := slices.IndexFunc(s.columns, func(c tableColumn) bool { return c.name == name })
	if i < 0 {
		return tableColumn{}, false
	}
	return s.columns[i], true
}

func (s tableShape) primaryKey() (tableKey, bool) {
	if len(s.keys) > 0 && s.keys[0].primary {
		return s.keys[0], true
	}
	return tableKey{}, false
}

// Fixes named by the table errors.
const (
	fixMigrate = "migrate deduplicator.MigrationLine(cfg) up at start-up (a migrate.Migrator, or its rendered Migrations in your migration tool)"
	fixConvert = "convert it with deduplicator.ConvertTable, which keeps every (event_id, consumer_group), or with the SQL of docs/operations.md \"Adopting an existing processed_event\""
)

// problem returns what makes the table unusable for claims, whatever the
// migration records say, or nil: existence, columns, partition key, keys.
func (s tableShape) problem(cfg TableConfig) *migrate.TableError {
	name := cfg.Schema + "." + cfg.Table
	fail := func(reason error, fix, format string, args ...any) *migrate.TableError {
		return &migrate.TableError{Component: "deduplicator", Table: name, Problem: fmt.Sprintf(format, args...), Fix: fix, Err: reason}
	}
	if !s.exists {
		return fail(ErrTableMissing, fixMigrate, "does not exist")
	}
	if s.kind != "r" && s.kind != "p" {
		return fail(ErrTableMissing, "drop or rename it, then "+fixMigrate, "is not a table (pg_class.relkind %q)", s.kind)
	}

	colErr := s.columnProblem(name, fail)
	keyErr := s.keyProblem(cfg, name, fail)
	switch {
	case colErr == nil:
		return keyErr
	case keyErr == nil:
		return colErr
	}
	// Both: the problem names the key too, and the fix ends with the
	// conversion, which sets the key.
	colErr.Problem += "; also: " + keyErr.Problem
	if !strings.Contains(colErr.Fix, "ConvertTable") {
		colErr.Fix += ", then " + fixConvert
	}
	return colErr
}

// fixNullGroup is the fix for a nullable consumer_group: ALTER ... SET NOT
// NULL fails on the rows that have none, which only the caller can name.
const fixNullGroup = "convert it with deduplicator.ConvertTable and ConvertOptions.ConsumerGroup set to the group that processed the rows whose consumer_group is NULL (idemctl dedup convert --group G); it also sets the column NOT NULL and the key (event_id, consumer_group)"

// columnProblem is problem for the columns.
func (s tableShape) columnProblem(name string, fail func(reason error, fix, format string, args ...any) *migrate.TableError) *migrate.TableError {
	for _, want := range wantColumns {
		got, ok := s.column(want.name)
		switch {
		case !ok && want.name == "consumer_group":
			return fail(ErrTableColumns, "convert it with deduplicator.ConvertTable and ConvertOptions.ConsumerGroup set to the group its rows belong to",
				"has no consumer_group column, so its rows cannot tell which consumer group processed them")
		case !ok:
			return fail(ErrTableColumns, "add the column ("+want.name+" "+want.typ+" NOT NULL)", "has no %s column", want.name)
		case got.typ != want.typ:
			fix := "ALTER TABLE " + name + " ALTER COLUMN " + want.name + " TYPE " + want.typ
			if want.name == "consumer_group" {
				fix = fixConvert
			}
			return fail(ErrTableColumns, fix, "column %s is %s, want %s", want.name, got.typ, want.typ)
		case !got.notNull && want.name == "consumer_group":
			return fail(ErrTableColumns, fixNullGroup, "column consumer_group is nullable, want NOT NULL: a row without a group cannot tell which consumer group processed it")
		case !got.notNull:
			return fail(ErrTableColumns, "ALTER TABLE "+name+" ALTER COLUMN "+want.name+" SET NOT NULL", "column %s is nullable, want NOT NULL", want.name)
		case want.hasDefault && !got.hasDefault:
			return fail(ErrTableColumns, "ALTER TABLE "+name+" ALTER COLUMN "+want.name+" SET DEFAULT now()",
				"column %s has no default, and claims insert only event_id and consumer_group", want.name)
		}
	}
	for _, got := range s.columns {
		if got.notNull && !got.hasDefault && !slices.ContainsFunc(wantColumns, func(w tableColumn) bool { return w.name == got.name }) {
			return fail(ErrTableColumns, "give "+got.name+" a default, make it nullable, or drop it",
				"column %s is NOT NULL without a default, so every claim (which inserts only event_id and consumer_group) would fail", got.name)
		}
	}
	return nil
}

// keyProblem is problem for the partitioning and the keys.
func (s tableShape) keyProblem(cfg TableConfig, name string, fail func(reason error, fix, format string, args ...any) *migrate.TableError) *migrate.TableError {
	if s.partitioned && !s.partOnID {
		return fail(ErrTableKey, fixConvert,
			"is partitioned by %s, want RANGE (event_id) or no partitioning: a redelivery gets a new partition key, hence a new primary key, and its handler runs again", s.partKey)
	}
	pk, ok := s.primaryKey()
	switch {
	case !ok:
		return fail(ErrTableKey, fixConvert, "has no primary key, want PRIMARY KEY (event_id, consumer_group): nothing stops a second claim of the same event")
	case !slices.Equal(pk.columns, []string{"event_id", "consumer_group"}):
		why := "claims would conflict on other columns than the event and the group"
		if slices.Equal(pk.columns, []string{"event_id"}) {
			why = "a second consumer group would skip every event another group already processed"
		} else if slices.Contains(pk.columns, "event_id") && slices.Contains(pk.columns, "consumer_group") {
			why = "a redelivery that differs in the other key columns is claimed again and its handler runs twice"
		}
		return fail(ErrTableKey, fixConvert, "primary key is (%s), want (event_id, consumer_group): %s", strings.Join(pk.columns, ", "), why)
	case pk.deferrable:
		return fail(ErrTableKey, fixConvert, "primary key %s is DEFERRABLE: a concurrent duplicate claim is not stopped at INSERT", pk.index)
	}
	for _, k := range s.keys[1:] {
		if k.exclusion || !slices.Contains(k.columns, "event_id") || !slices.Contains(k.columns, "consumer_group") {
			kind := "unique index"
			if k.exclusion {
				kind = "exclusion constraint"
			}
			fix := "DROP INDEX " + cfg.Schema + "." + k.index
			if k.constraint != "" {
				fix = "ALTER TABLE " + name + " DROP CONSTRAINT " + k.constraint
			}
			return fail(ErrTableKey, fix,
				"%s %s on (%s) also decides claims (ON CONFLICT DO NOTHING skips on any unique key): an event could be skipped by a group that never processed it",
				kind, k.index, strings.Join(k.columns, ", "))
		}
	}
	return nil
}

func joinVersions(versions []int) string {
	s := make([]string, len(versions))
	for i, v := range versions {
		s[i] = fmt.Sprint(v)
	}
	return strings.Join(s, ", ")
}
