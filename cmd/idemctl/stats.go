package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
)

// tableStats is what `dedup stats` counts in a processed_event table: its
// catalog view (dedupsql.Inspect) and its claims per consumer group and
// per partition.
type tableStats struct {
	info *dedupsql.TableInfo
	claims
	groups     []groupStats     // registered or holding claims, by name
	partitions []partitionStats // in the order of info.Partitions
}

// claims counts claims, with the earliest and the latest processed_at
// among them (zero when there are none).
type claims struct {
	Rows           int64
	Oldest, Newest time.Time
}

func (c *claims) add(n int64, oldest, newest time.Time) {
	c.Rows += n
	if c.Oldest.IsZero() || (!oldest.IsZero() && oldest.Before(c.Oldest)) {
		c.Oldest = oldest
	}
	if newest.After(c.Newest) {
		c.Newest = newest
	}
}

type groupStats struct {
	Group      string
	Registered bool // in the table's registry (dedupsql.Groups)
	claims
}

type partitionStats struct {
	partition.Info
	claims
}

// readStats reads every row of the table named by tc, in one read-only
// repeatable-read transaction so that the counts agree: on a big table it
// takes as long as a count(*).
func readStats(ctx context.Context, db interface {
	BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
}, tc deduplicator.TableConfig) (*tableStats, error) {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // it only reads
	st := &tableStats{}
	if st.info, err = dedupsql.Inspect(ctx, tx, tc.Schema, tc.Table); err != nil {
		return nil, err
	}
	registered, err := dedupsql.Groups(ctx, tx, tc.Schema, tc.Table)
	if err != nil {
		return nil, err
	}
	byGroup := map[string]*groupStats{}
	for _, g := range registered {
		byGroup[g.Name] = &groupStats{Group: g.Name, Registered: true}
	}
	byName := map[string]*partitionStats{}
	st.partitions = make([]partitionStats, len(st.info.Partitions))
	for i, p := range st.info.Partitions {
		st.partitions[i].Info = p
		byName[p.Name] = &st.partitions[i]
	}
	rows, err := tx.Query(ctx, `SELECT c.relname::text, s.consumer_group, s.n, s.oldest, s.newest
FROM (SELECT tableoid, consumer_group, count(*) AS n, min(processed_at) AS oldest, max(processed_at) AS newest
      FROM `+ident.Quote(tc.Schema, tc.Table)+` GROUP BY 1, 2) s
JOIN pg_catalog.pg_class c ON c.oid = s.tableoid`)
	if err != nil {
		return nil, fmt.Errorf("stats of %s.%s: %w", tc.Schema, tc.Table, err)
	}
	var (
		part, group    string
		n              int64
		oldest, newest pgtype.Timestamptz
	)
	_, err = pgx.ForEachRow(rows, []any{&part, &group, &n, &oldest, &newest}, func() error {
		st.add(n, oldest.Time, newest.Time)
		g := byGroup[group]
		if g == nil {
			g = &groupStats{Group: group}
			byGroup[group] = g
		}
		g.add(n, oldest.Time, newest.Time)
		if p := byName[part]; p != nil {
			p.add(n, oldest.Time, newest.Time)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("stats of %s.%s: %w", tc.Schema, tc.Table, err)
	}
	for _, g := range byGroup {
		st.groups = append(st.groups, *g)
	}
	slices.SortFunc(st.groups, func(a, b groupStats) int { return cmp.Compare(a.Group, b.Group) })
	return st, nil
}
