package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// ConvertOptions tunes [ConvertTable].
type ConvertOptions struct {
	// ConsumerGroup is the consumer group that processed the rows that do
	// not name one: every row of a table without a consumer_group column
	// (used by one group only), or the rows whose consumer_group is NULL
	// (a table whose code inserted only event_id). Required for
	// such tables; refused for a table whose consumer_group is NOT NULL
	// (its rows keep their own groups). Defaults to empty.
	ConsumerGroup string
	// DryRun converts inside the transaction and rolls it back: the result
	// says what a conversion would do (rows kept and merged), and nothing
	// changes. It takes the same locks as a conversion, for as long.
	// Defaults to false.
	DryRun bool
}

// ConvertResult reports what [ConvertTable] did.
type ConvertResult struct {
	// Converted is false when the table already had the expected columns
	// and key: nothing was copied (the migrations still ran). With
	// [ConvertOptions.DryRun], it says whether a conversion would copy.
	Converted bool
	// DryRun is true when everything was rolled back
	// ([ConvertOptions.DryRun]).
	DryRun bool
	// Was describes what was wrong with the old table (the Problem of the
	// [*migrate.TableError] that [Check] would have returned).
	Was string
	// Rows counts the rows of the old table; Kept those of the new one.
	Rows, Kept int64
	// Collapsed = Rows - Kept: extra rows of an (event_id, consumer_group)
	// stored more than once, which only a table keyed otherwise (e.g. by
	// (event_id, processed_at)) can hold, or which a NULL consumer_group
	// becomes once it takes [ConvertOptions.ConsumerGroup]. The row with
	// the earliest processed_at is kept.
	Collapsed int64
	// GroupFilled counts the rows that took [ConvertOptions.ConsumerGroup]
	// (every row without a consumer_group column; the NULL ones with it).
	GroupFilled int64
}

// ConvertTable turns an existing processed_event table that [Check] refuses
// for its key or partitioning (the reference recipe's PRIMARY KEY
// (event_id), partitions on processed_at, a table without a primary key or
// without a consumer_group column, or one whose consumer_group or
// processed_at is nullable) into the table [MigrationLine] makes for cfg,
// keeping one row per (event_id, consumer_group): the one with the earliest
// processed_at. Then it runs Migrate, in the same transaction, so the result
// passes Check; with [LayoutPartitioned] the rows end up in daily partitions
// on event_id.
//
// Everything happens in one transaction holding the migration lock of the
// schema and an ACCESS EXCLUSIVE lock on the table: claims on it wait until
// the commit, so stop the consumers first on a big table. On any error
// nothing changes. The table is rebuilt: its privileges, owner, comments,
// triggers and other indexes are not carried over (grant them again), and a
// view or foreign key depending on it makes the conversion fail. The old
// table may have only the columns event_id (uuid), consumer_group (text or
// varchar; or none, see [ConvertOptions.ConsumerGroup]) and processed_at
// (timestamptz): any other column is refused rather than dropped. A NULL
// consumer_group takes [ConvertOptions.ConsumerGroup] (a table holding one
// without it is refused, naming the option); a NULL processed_at becomes
// the conversion's time (the claim is then kept for a whole retention); a
// NULL event_id is refused (such a row names no event: delete it).
//
// A table that is already right is left as it is (Converted false); a
// missing table is an error ([ErrTableMissing]): there is nothing to adopt.
// db is a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx (then a savepoint).
func ConvertTable(ctx context.Context, db migrate.Beginner, cfg TableConfig, opts ConvertOptions) (res ConvertResult, err error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return res, err
	}
	if err := ValidateGroupName("ConvertOptions.ConsumerGroup", opts.ConsumerGroup); err != nil {
		return res, err
	}
	migs, err := loadMigrations(cfg)
	if err != nil {
		return res, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("deduplicator: convert: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	if err := migtable.Lock(ctx, tx, cfg.Schema); err != nil {
		return res, fmt.Errorf("deduplicator: convert: migration lock: %w", err)
	}
	shape, err := inspectTable(ctx, tx, cfg.Schema, cfg.Table)
	if err != nil {
		return res, err
	}
	terr := shape.problem(cfg)
	if terr != nil && errors.Is(terr, ErrTableMissing) {
		return res, terr
	}
	if terr != nil {
		// Lock, then look again: the table may have changed meanwhile.
		if _, err := tx.Exec(ctx, "LOCK TABLE "+ident.Quote(cfg.Schema, cfg.Table)+" IN ACCESS EXCLUSIVE MODE"); err != nil {
			return res, fmt.Errorf("deduplicator: convert: lock table: %w", err)
		}
		if shape, err = inspectTable(ctx, tx, cfg.Schema, cfg.Table); err != nil {
			return res, err
		}
		terr = shape.problem(cfg)
	}
	if opts.ConsumerGroup != "" {
		if err := (Config{TableConfig: cfg, ConsumerGroup: opts.ConsumerGroup}).validate(); err != nil {
			return res, fmt.Errorf("deduplicator: convert: ConvertOptions.%w", err)
		}
	}
	if terr == nil {
		if opts.ConsumerGroup != "" {
			return res, &migrate.TableError{Component: "deduplicator", Table: cfg.Schema + "." + cfg.Table, Problem: "ConvertOptions.ConsumerGroup is set but the table's consumer_group column is NOT NULL", Fix: "leave ConvertOptions.ConsumerGroup empty: the rows keep their own groups", Err: ErrTableColumns}
		}
	} else {
		res.Was = terr.Problem
		if err := rebuild(ctx, tx, cfg, shape, opts, migs, &res); err != nil {
			return ConvertResult{}, err
		}
		res.Converted = true
	}
	if err := migrateUp(ctx, tx, cfg); err != nil {
		return ConvertResult{}, fmt.Errorf("deduplicator: convert: %w", err)
	}
	if opts.DryRun {
		if err := tx.Rollback(ctx); err != nil {
			return ConvertResult{}, fmt.Errorf("deduplicator: convert: roll back the dry run: %w", err)
		}
		res.DryRun = true
		return res, nil
	}
	if err := tx.Commit(ctx); err != nil {
		return ConvertResult{}, fmt.Errorf("deduplicator: convert: commit: %w", err)
	}
	return res, nil
}

// convertedSuffix names the old table while its rows are copied, inside the
// conversion's transaction (nobody else ever sees it).
const convertedSuffix = "_unconverted"

// rebuild moves the locked old table aside, creates the table of migration
// 1 in its place, copies one row per (event_id, consumer_group) and drops
// the old table; versions of the partitioned layout recorded for the old
// table are forgotten, so Migrate converts the new table again.
func rebuild(ctx context.Context, tx pgx.Tx, cfg TableConfig, shape tableShape, opts ConvertOptions, migs []migtable.Version, res *ConvertResult) error {
	c := converter{ctx: ctx, tx: tx, cfg: cfg, name: cfg.Schema + "." + cfg.Table, table: ident.Quote(cfg.Schema, cfg.Table)}
	if err := c.checkColumns(shape); err != nil {
		return err
	}
	_, hasGroup := shape.column("consumer_group")
	nullGroups, err := c.checkNulls(shape, opts)
	if err != nil {
		return err
	}
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+c.table).Scan(&res.Rows); err != nil {
		return fmt.Errorf("deduplicator: convert %s: count rows: %w", c.name, err)
	}
	if err := c.freeIndexNames(shape); err != nil {
		return err
	}
	old, err := c.moveAside()
	if err != nil {
		return err
	}
	i := slices.IndexFunc(migs, func(m migtable.Version) bool { return m.Version == 1 })
	if i < 0 {
		return errors.New("deduplicator: convert: no migration version 1")
	}
	if _, err := c.exec("create the table (migration 1)", migs[i].Up); err != nil {
		return err
	}
	if !hasGroup {
		res.GroupFilled = res.Rows
	} else if opts.ConsumerGroup != "" {
		res.GroupFilled = nullGroups
	}
	if res.Kept, err = c.copyRows(old, hasGroup, opts.ConsumerGroup); err != nil {
		return err
	}
	res.Collapsed = res.Rows - res.Kept
	if _, err := c.exec("drop the old table", "DROP TABLE "+old); err != nil {
		return err
	}
	// The new table is plain: the versions only the partitioned layout has
	// must run again.
	versions, err := partitionedOnlyVersions(cfg)
	if err != nil {
		return err
	}
	if err := migtable.Forget(ctx, tx, cfg.Schema, componentKey(cfg), versions); err != nil {
		return fmt.Errorf("deduplicator: convert %s: forget partitioned versions: %w", c.name, err)
	}
	return nil
}

// converter holds what each step of [rebuild] needs: the transaction and
// the table's names (name for messages, table quoted for SQL).
type converter struct {
	ctx   context.Context
	tx    pgx.Tx
	cfg   TableConfig
	name  string
	table string
}

func (c converter) refuse(fix, format string, args ...any) error {
	return &migrate.TableError{Component: "deduplicator", Table: c.name, Problem: fmt.Sprintf(format, args...), Fix: fix, Err: ErrTableColumns}
}

func (c converter) exec(what, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := c.tx.Exec(c.ctx, sql, args...)
	if err != nil {
		return tag, fmt.Errorf("deduplicator: convert %s: %s: %w", c.name, what, err)
	}
	return tag, nil
}

// checkColumns refuses a table with a column whose values would not
// survive the copy, or without event_id or processed_at.
func (c converter) checkColumns(shape tableShape) error {
	name := c.name
	for _, col := range shape.columns {
		switch {
		case col.name == "event_id" && col.typ != "uuid":
			return c.refuse("ALTER TABLE "+name+" ALTER COLUMN event_id TYPE uuid USING event_id::uuid, then convert", "cannot convert: event_id is %s, want uuid", col.typ)
		case col.name == "processed_at" && col.typ != "timestamp with time zone":
			return c.refuse("ALTER TABLE "+name+" ALTER COLUMN processed_at TYPE timestamptz USING processed_at AT TIME ZONE '<the zone its values are in>', then convert", "cannot convert: processed_at is %s, want timestamp with time zone", col.typ)
		case col.name == "consumer_group" && !slices.Contains([]string{"text", "character varying", "character"}, baseType(col.typ)):
			return c.refuse("ALTER TABLE "+name+" ALTER COLUMN consumer_group TYPE text, then convert", "cannot convert: consumer_group is %s, want text", col.typ)
		case col.name != "event_id" && col.name != "processed_at" && col.name != "consumer_group":
			return c.refuse("drop the column or copy the table by hand (see docs/operations.md)", "cannot convert: column %s would be lost (the table is rebuilt with event_id, consumer_group, processed_at only)", col.name)
		}
	}
	for _, want := range []string{"event_id", "processed_at"} {
		if _, ok := shape.column(want); !ok {
			return c.refuse("add the column, then convert", "cannot convert: there is no %s column", want)
		}
	}
	return nil
}

// checkNulls refuses rows without an event, and a group option that does
// not fit the table's consumer_group column; it returns the count of rows
// whose consumer_group is NULL.
func (c converter) checkNulls(shape tableShape, opts ConvertOptions) (int64, error) {
	name := c.name
	group, hasGroup := shape.column("consumer_group")
	var nullEvents, nullGroups int64
	if err := c.tx.QueryRow(c.ctx, "SELECT count(*) FILTER (WHERE event_id IS NULL), count(*) FILTER (WHERE "+
		map[bool]string{true: "consumer_group IS NULL", false: "false"}[hasGroup]+") FROM "+c.table).Scan(&nullEvents, &nullGroups); err != nil {
		return 0, fmt.Errorf("deduplicator: convert %s: count NULLs: %w", name, err)
	}
	switch {
	case nullEvents > 0:
		return 0, c.refuse("DELETE FROM "+name+" WHERE event_id IS NULL (such rows name no event and decide nothing), then convert",
			"cannot convert: %d rows have a NULL event_id", nullEvents)
	case hasGroup && group.notNull && opts.ConsumerGroup != "":
		return 0, c.refuse("leave ConvertOptions.ConsumerGroup empty: the rows keep their own groups", "ConvertOptions.ConsumerGroup is set but the table's consumer_group column is NOT NULL")
	case hasGroup && nullGroups > 0 && opts.ConsumerGroup == "":
		return 0, c.refuse("set ConvertOptions.ConsumerGroup (idemctl dedup convert --group) to the consumer group that processed the rows whose consumer_group is NULL",
			"cannot convert: %d rows have a NULL consumer_group and ConvertOptions.ConsumerGroup is empty", nullGroups)
	case !hasGroup && opts.ConsumerGroup == "":
		return 0, c.refuse("set ConvertOptions.ConsumerGroup (idemctl dedup convert --group) to the consumer group that processed these rows", "cannot convert: the table has no consumer_group column and ConvertOptions.ConsumerGroup is empty")
	}
	return nullGroups, nil
}

// freeIndexNames drops the old table's indexes and constraints named as
// the new table's migration names its own (index names are per schema).
func (c converter) freeIndexNames(shape tableShape) error {
	rows, err := c.tx.Query(c.ctx, `SELECT ic.relname::text, COALESCE(con.conname::text, '')
FROM pg_catalog.pg_index i
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
LEFT JOIN pg_catalog.pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
WHERE i.indrelid = $1::oid AND ic.relname = ANY($2)`, shape.oid, []string{c.cfg.Table + "_pkey", c.cfg.Table + "_processed_at_idx"})
	if err != nil {
		return fmt.Errorf("deduplicator: convert %s: list indexes: %w", c.name, err)
	}
	clashes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]string, error) {
		var v [2]string
		err := r.Scan(&v[0], &v[1])
		return v, err
	})
	if err != nil {
		return fmt.Errorf("deduplicator: convert %s: list indexes: %w", c.name, err)
	}
	for _, cl := range clashes {
		if cl[1] != "" {
			_, err = c.exec("drop constraint "+cl[1], "ALTER TABLE "+c.table+" DROP CONSTRAINT "+ident.Quote(cl[1]))
		} else {
			_, err = c.exec("drop index "+cl[0], "DROP INDEX "+ident.Quote(c.cfg.Schema, cl[0]))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// moveAside renames the old table to its name with convertedSuffix and
// returns that name quoted.
func (c converter) moveAside() (string, error) {
	oldName := c.cfg.Table + convertedSuffix
	if len(oldName) > 63 {
		oldName = c.cfg.Table[:63-len(convertedSuffix)] + convertedSuffix
	}
	if _, err := c.exec("rename to "+oldName, "ALTER TABLE "+c.table+" RENAME TO "+ident.Quote(oldName)); err != nil {
		if pgerr.Has(err, pgerrcode.DuplicateTable) {
			return "", fmt.Errorf("%w (a table %s.%s exists: drop or rename it)", err, c.cfg.Schema, oldName)
		}
		return "", err
	}
	return ident.Quote(c.cfg.Schema, oldName), nil
}

// copyRows copies one row per (event_id, consumer_group) from old into the
// new table and returns the rows kept. A NULL group takes group; a NULL
// processed_at sorts last (a row with a time wins) and becomes now().
func (c converter) copyRows(old string, hasGroup bool, group string) (int64, error) {
	groupExpr := "COALESCE(consumer_group::text, $1::text)"
	if !hasGroup {
		groupExpr = "$1::text"
	}
	copySQL := `INSERT INTO ` + c.table + ` (event_id, consumer_group, processed_at)
SELECT DISTINCT ON (event_id, consumer_group) event_id, consumer_group, COALESCE(processed_at, now())
FROM (SELECT event_id, ` + groupExpr + ` AS consumer_group, processed_at FROM ` + old + `) o
ORDER BY event_id, consumer_group, processed_at`
	tag, err := c.exec("copy rows", copySQL, group)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// partitionedOnlyVersions returns the versions of [LayoutPartitioned] that
// [LayoutPlain] does not have.
func partitionedOnlyVersions(cfg TableConfig) ([]int, error) {
	cfg.Layout = LayoutPlain
	plain, err := loadMigrations(cfg)
	if err != nil {
		return nil, err
	}
	cfg.Layout = LayoutPartitioned
	part, err := loadMigrations(cfg)
	if err != nil {
		return nil, err
	}
	var versions []int
	for _, m := range part {
		if !slices.ContainsFunc(plain, func(p migtable.Version) bool { return p.Version == m.Version }) {
			versions = append(versions, m.Version)
		}
	}
	return versions, nil
}

// baseType strips a type modifier: "character varying(100)" → "character varying".
func baseType(t string) string {
	base, _, _ := strings.Cut(t, "(")
	return base
}
