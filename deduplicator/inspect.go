package deduplicator

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

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

// listPartitions reads the partitions of table (quoted): the daily ones in
// the order of their bounds, then the DEFAULT one and any other.
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
		return cmp.Compare(a.Name, b.Name)
	})
	return parts, nil
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
	// Partitions are the table's partitions (LayoutPartitioned): the daily
	// ones in the order of their bounds, then the DEFAULT one and any
	// other; empty for a plain table.
	Partitions []Partition
}

// Inspect reads the table named by cfg (its Layout field is ignored) from
// the catalog and its setting: four queries at most, whatever it holds,
// for dashboards and the operator's console (idemctl dedup stats counts
// the rows instead). A missing table is [ErrTableMissing].
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
