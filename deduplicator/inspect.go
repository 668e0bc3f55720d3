package deduplicator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// ProcessedAt reports whether eventID has a committed claim for the group
// and, if so, the claim's processed_at: when the transaction that applied
// the event began.
func (d *Deduplicator) ProcessedAt(ctx context.Context, db migrate.DBTX, eventID uuid.UUID) (at time.Time, ok bool, err error) {
	err = db.QueryRow(ctx, d.processedAtSQL, eventID, d.cfg.ConsumerGroup).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("processed at %s: %w", eventID, notMigrated(err))
	}
	return at, true, nil
}

// tableLayout returns the layout of the live table named by cfg (its Layout
// field is ignored): [LayoutPartitioned] when it is partitioned, else
// [LayoutPlain]. A missing table is [ErrTableMissing].
func tableLayout(ctx context.Context, db migrate.DBTX, cfg TableConfig) (Layout, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return 0, err
	}
	exists, partitioned, err := partition.Partitioned(ctx, db, ident.Quote(cfg.Schema, cfg.Table))
	switch {
	case err != nil:
		return 0, fmt.Errorf("layout of %s.%s: %w", cfg.Schema, cfg.Table, err)
	case !exists:
		return 0, fmt.Errorf("layout of %s.%s: %w", cfg.Schema, cfg.Table, ErrTableMissing)
	case partitioned:
		return LayoutPartitioned, nil
	default:
		return LayoutPlain, nil
	}
}

// Partition is one partition of a processed_event table in
// [LayoutPartitioned].
type Partition struct {
	// Name is the partition's table, in the table's schema:
	// <table>_pYYYYMMDD, <table>_default, or any name for one attached by
	// hand.
	Name string
	// Default is true for the DEFAULT partition, which holds the ids outside
	// every other partition.
	Default bool
	// From and To are the creation times of the partition's UUIDv7 bounds:
	// it holds the events created in [From, To), for a daily partition one
	// UTC day. Zero for the DEFAULT partition and bounds that are not
	// UUIDv7 floors.
	From, To time.Time
	// Bound is the partition bound as PostgreSQL prints it: FOR VALUES FROM
	// ('…') TO ('…'), or DEFAULT.
	Bound string
	// Bytes is the partition's size on disk, with its indexes and TOAST
	// (pg_total_relation_size).
	Bytes int64

	oid      uint32
	parsed   bool // fromID/toID hold the bounds
	from, to uuid.UUID
}

// Partitions lists the partitions of the table named by cfg (its Layout
// field is ignored): the daily ones in the order of their bounds, then the
// DEFAULT one and any other. A plain table has none. It only reads the
// catalogs; a missing table is [ErrTableMissing].
func Partitions(ctx context.Context, db migrate.DBTX, cfg TableConfig) ([]Partition, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	if _, err := tableLayout(ctx, db, cfg); err != nil {
		return nil, fmt.Errorf("partitions: %w", err)
	}
	parts, err := listPartitions(ctx, db, ident.Quote(cfg.Schema, cfg.Table))
	if err != nil {
		return nil, fmt.Errorf("partitions of %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return parts, nil
}

// listPartitions reads the partitions of table (quoted), sorted as
// [Partitions] documents.
func listPartitions(ctx context.Context, db migrate.DBTX, table string) ([]Partition, error) {
	rows, err := db.Query(ctx, `SELECT c.oid, c.relname::text, pg_get_expr(c.relpartbound, c.oid), pg_total_relation_size(c.oid)
FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1)`, table)
	if err != nil {
		return nil, err
	}
	parts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Partition, error) {
		var p Partition
		if err := r.Scan(&p.oid, &p.Name, &p.Bound, &p.Bytes); err != nil {
			return p, err
		}
		if p.Bound == "DEFAULT" {
			p.Default = true
			return p, nil
		}
		if m := boundRe.FindStringSubmatch(p.Bound); m != nil {
			p.from, p.to, p.parsed = uuid.MustParse(m[1]), uuid.MustParse(m[2]), true
			from, okFrom := partition.Time(p.from)
			to, okTo := partition.Time(p.to)
			if okFrom && okTo && partition.Floor(from) == p.from && partition.Floor(to) == p.to {
				p.From, p.To = from, to
			}
		}
		return p, nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(parts, func(a, b Partition) int {
		if a.parsed != b.parsed {
			if a.parsed {
				return -1
			}
			return 1
		}
		if a.parsed {
			if c := bytes.Compare(a.from[:], b.from[:]); c != 0 {
				return c
			}
		}
		if a.Default != b.Default {
			if b.Default {
				return -1
			}
			return 1
		}
		return cmpString(a.Name, b.Name)
	})
	return parts, nil
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// TableStats is what [Stats] counted in a processed_event table.
type TableStats struct {
	// Schema and Table name the table.
	Schema, Table string
	// Layout is the live table's, whatever TableConfig.Layout says.
	Layout Layout
	// Retention is the retention recorded with the table, and CleanedBefore
	// the highest cutoff the Cleaner has applied (zero: never).
	Retention     time.Duration
	CleanedBefore time.Time
	// Rows counts the claims; Oldest and Newest are the earliest and the
	// latest processed_at among them (zero when there are none).
	Rows           int64
	Oldest, Newest time.Time
	// Bytes is the size on disk of the table, every partition, their
	// indexes and TOAST.
	Bytes int64
	// Groups are the consumer groups that hold claims or are registered
	// (see [Groups]), by name.
	Groups []GroupStats
	// Partitions are the table's partitions (LayoutPartitioned), in the
	// order of [Partitions]; empty for a plain table.
	Partitions []PartitionStats
}

// GroupStats counts one consumer group's claims.
type GroupStats struct {
	Group string
	// Registered is true when the group is in the table's registry
	// (<table>_group); a group holding claims without it has not started
	// since the registry was created.
	Registered bool
	// Rows counts the group's claims; Oldest and Newest are the earliest and
	// the latest processed_at among them (zero when there are none).
	Rows           int64
	Oldest, Newest time.Time
}

// PartitionStats counts the claims of one partition.
type PartitionStats struct {
	Partition
	// Rows counts the partition's claims; Oldest and Newest are the earliest
	// and the latest processed_at among them (zero when there are none).
	Rows           int64
	Oldest, Newest time.Time
}

// Stats counts the claims of the table named by cfg (its Layout field is
// ignored) per consumer group and per partition, with the oldest and newest
// processed_at of each, the table's size on disk and its recorded
// retention. It reads every row, in one read-only repeatable-read
// transaction so the counts agree (on a pgx.Tx, in a savepoint of it): on a big table it takes as long as a count(*) (a sequential
// scan), so run it from an operator's shell, not on a hot path. A missing
// table is [ErrTableMissing].
func Stats(ctx context.Context, db migrate.Beginner, cfg TableConfig) (*TableStats, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	st := &TableStats{Schema: cfg.Schema, Table: cfg.Table, Groups: []GroupStats{}, Partitions: []PartitionStats{}}
	var tx pgx.Tx
	if b, ok := db.(interface {
		BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
	}); ok {
		tx, err = b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	} else {
		tx, err = db.Begin(ctx) // a pgx.Tx: a savepoint of the caller's snapshot
	}
	if err == nil {
		err = stats(ctx, tx, cfg, st)
		_ = tx.Rollback(context.WithoutCancel(ctx)) // it only read
	}
	if err != nil {
		return nil, fmt.Errorf("stats of %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return st, nil
}

func stats(ctx context.Context, tx pgx.Tx, cfg TableConfig, st *TableStats) error {
	var err error
	if st.Layout, err = tableLayout(ctx, tx, cfg); err != nil {
		return err
	}
	s, err := readSetting(ctx, tx, cfg)
	if err != nil {
		return err
	}
	st.Retention, st.CleanedBefore = s.retention, s.cleanedBefore
	table := ident.Quote(cfg.Schema, cfg.Table)
	parts, err := listPartitions(ctx, tx, table)
	if err != nil {
		return err
	}
	if err := tx.QueryRow(ctx, "SELECT pg_total_relation_size(to_regclass($1))", table).Scan(&st.Bytes); err != nil {
		return err
	}
	byOID := make(map[uint32]int, len(parts))
	for i, p := range parts {
		byOID[p.oid] = i
		st.Bytes += p.Bytes
		st.Partitions = append(st.Partitions, PartitionStats{Partition: p})
	}
	registered, err := groups(ctx, tx, cfg)
	if err != nil {
		return err
	}
	byGroup := map[string]*GroupStats{}
	for _, g := range registered {
		byGroup[g.Name] = &GroupStats{Group: g.Name, Registered: true}
	}

	rows, err := tx.Query(ctx, "SELECT tableoid::oid, consumer_group, count(*), min(processed_at), max(processed_at) FROM "+table+" GROUP BY 1, 2")
	if err != nil {
		return err
	}
	var (
		oid            uint32
		group          string
		n              int64
		oldest, newest pgtype.Timestamptz
	)
	_, err = pgx.ForEachRow(rows, []any{&oid, &group, &n, &oldest, &newest}, func() error {
		o, nw := oldest.Time, newest.Time
		st.Rows += n
		st.Oldest, st.Newest = earliest(st.Oldest, o), latest(st.Newest, nw)
		g := byGroup[group]
		if g == nil {
			g = &GroupStats{Group: group}
			byGroup[group] = g
		}
		g.Rows += n
		g.Oldest, g.Newest = earliest(g.Oldest, o), latest(g.Newest, nw)
		if i, ok := byOID[oid]; ok {
			p := &st.Partitions[i]
			p.Rows += n
			p.Oldest, p.Newest = earliest(p.Oldest, o), latest(p.Newest, nw)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, g := range byGroup {
		st.Groups = append(st.Groups, *g)
	}
	slices.SortFunc(st.Groups, func(a, b GroupStats) int { return cmpString(a.Group, b.Group) })
	return nil
}

// earliest and latest fold a time into a running minimum or maximum whose
// zero value means "none yet".
func earliest(cur, t time.Time) time.Time {
	if cur.IsZero() || (!t.IsZero() && t.Before(cur)) {
		return t
	}
	return cur
}

func latest(cur, t time.Time) time.Time {
	if t.After(cur) {
		return t
	}
	return cur
}

// TableInfo is what [Inspect] reads about a processed_event table without
// reading its rows: the catalog and the table's recorded setting.
type TableInfo struct {
	// Schema and Table name the table.
	Schema, Table string
	// Layout is the live table's, whatever TableConfig.Layout says.
	Layout Layout
	// Retention is the retention recorded with the table.
	Retention time.Duration
	// CleanedBefore is the highest cutoff the Cleaner has applied (zero:
	// never). Each pass sets it to the pass's time less the retention, so
	// CleanedBefore + Retention is when the last pass ran.
	CleanedBefore time.Time
	// RowsEstimate is the planner's row count of the table and its
	// partitions (pg_class.reltuples, as of the last ANALYZE, VACUUM or
	// autovacuum; 0 before the first), never a count(*).
	RowsEstimate int64
	// Bytes is the size on disk of the table, every partition, their
	// indexes and TOAST.
	Bytes int64
	// Partitions are the table's partitions (LayoutPartitioned), in the
	// order of [Partitions]; empty for a plain table.
	Partitions []Partition
}

// Inspect reads the table named by cfg (its Layout field is ignored) from
// the catalog and its setting: four queries at most, whatever it holds,
// for dashboards and the operator's console. [Stats] counts the rows
// instead. A missing table is [ErrTableMissing].
func Inspect(ctx context.Context, db migrate.DBTX, cfg TableConfig) (*TableInfo, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	info := &TableInfo{Schema: cfg.Schema, Table: cfg.Table, Partitions: []Partition{}}
	if info.Layout, err = tableLayout(ctx, db, cfg); err != nil {
		return nil, err
	}
	s, err := readSetting(ctx, db, cfg)
	if err != nil {
		return nil, err
	}
	info.Retention, info.CleanedBefore = s.retention, s.cleanedBefore
	table := ident.Quote(cfg.Schema, cfg.Table)
	// reltuples is -1 before the first ANALYZE; a partitioned parent's
	// (relkind p) counts its partitions' rows again.
	err = db.QueryRow(ctx, `SELECT COALESCE(sum(GREATEST(c.reltuples, 0)) FILTER (WHERE c.relkind <> 'p'), 0)::bigint, COALESCE(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_catalog.pg_class c
WHERE c.oid = to_regclass($1) OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhparent = to_regclass($1))`, table).Scan(&info.RowsEstimate, &info.Bytes)
	if err != nil {
		return nil, fmt.Errorf("inspect %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	if info.Layout == LayoutPartitioned {
		if info.Partitions, err = listPartitions(ctx, db, table); err != nil {
			return nil, fmt.Errorf("partitions of %s.%s: %w", cfg.Schema, cfg.Table, err)
		}
	}
	return info, nil
}
