package dedupsql

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/partition"
)

// TableInfo is what [Inspect] reads about a processed_event table without
// reading its rows: the catalog and the table's recorded setting.
type TableInfo struct {
	// Schema and Table name the table.
	Schema, Table string
	// Layout is the live table's: "plain" or "partitioned" (the names of
	// deduplicator.Layout), whatever the configuration says.
	Layout string
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
	// Partitions are the table's partitions (partitioned layout): the daily
	// ones in the order of their bounds, then the DEFAULT one and any
	// other; empty for a plain table.
	Partitions []partition.Info
}

// Inspect reads schema.table from the catalog and its setting: four
// queries at most, whatever it holds, for dashboards and the operator's
// console (idemctl dedup stats counts the rows instead). A missing table is
// [ErrTableMissing].
func Inspect(ctx context.Context, db dbx.Querier, schema, table string) (*TableInfo, error) {
	schema, table = claimsql.Names(schema, table)
	info := &TableInfo{Schema: schema, Table: table, Layout: "plain", Partitions: []partition.Info{}}
	t := Table(schema, table)
	exists, partitioned, err := partition.Partitioned(ctx, db, t)
	switch {
	case err != nil:
		return nil, fmt.Errorf("layout of %s.%s: %w", schema, table, err)
	case !exists:
		return nil, fmt.Errorf("layout of %s.%s: %w", schema, table, ErrTableMissing)
	case partitioned:
		info.Layout = "partitioned"
	}
	s, err := ReadSetting(ctx, db, schema, table)
	if err != nil {
		return nil, fmt.Errorf("read retention of %s: %w", t, err)
	}
	info.Retention, info.CleanedBefore = s.Retention, s.CleanedBefore
	// reltuples is -1 before the first ANALYZE; a partitioned parent's
	// (relkind p) counts its partitions' rows again.
	err = db.QueryRow(ctx, `SELECT COALESCE(sum(GREATEST(c.reltuples, 0)) FILTER (WHERE c.relkind <> 'p'), 0)::bigint, COALESCE(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_catalog.pg_class c
WHERE c.oid = to_regclass($1) OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhparent = to_regclass($1))`, t).Scan(&info.RowsEstimate, &info.Bytes)
	if err != nil {
		return nil, fmt.Errorf("inspect %s.%s: %w", schema, table, err)
	}
	if partitioned {
		if info.Partitions, err = partition.List(ctx, db, t); err != nil {
			return nil, fmt.Errorf("partitions of %s.%s: %w", schema, table, err)
		}
	}
	return info, nil
}
