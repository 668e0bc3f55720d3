package deduplicator

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// The processed_at index (migration 004) holds the non-v7 claims alone: a
// v7 claim writes the heap and the primary key, nothing else; the
// Cleaner's non-v7 batch can be read from the index; Check accepts the
// table; going down to version 3 gives back the full index.
func TestProcessedAtIndexHoldsNonV7ClaimsAlone(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	v7 := make([]uuid.UUID, 5)
	for i := range v7 {
		v7[i] = v7At(now.Add(-time.Duration(i) * time.Hour))
	}
	insertRows(t, db.Pool, tc, "a", now, v7...)
	insertRows(t, db.Pool, tc, "a", now, uuid.New(), uuid.New())
	// The index's predicate keeps the v7 claims out of it. Its definition is
	// read for this one index: pg_indexes' indexdef may be evaluated for
	// every index of the server, and fails (XX000, "could not open
	// relation") on one a parallel test is dropping.
	require.Equal(t, 1, db.Count(t, "SELECT 1 WHERE pg_get_indexdef(to_regclass(quote_ident($1) || '.' || quote_ident($2))) LIKE '%WHERE ((get_byte(uuid_send(event_id), 6) >> 4) <> 7)'",
		tc.Schema, tc.Table+"_processed_at_non_v7_idx"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = $2", tc.Schema, tc.Table+"_processed_at_idx"))

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SET LOCAL enable_seqscan = off")
	require.NoError(t, err)
	rows, err := tx.Query(ctx, "EXPLAIN "+nonV7Batch(tc.Schema+"."+tc.Table), now, 10)
	require.NoError(t, err)
	var plan []string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	require.Contains(t, strings.Join(plan, "\n"), tc.Table+"_processed_at_non_v7_idx", "the Cleaner's non-v7 batch reads the partial index")
	var n int
	require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM ("+nonV7Batch(tc.Schema+"."+tc.Table)+") b", now.Add(time.Second), 10).Scan(&n))
	require.Equal(t, 2, n, "the two v4 claims")
	require.NoError(t, tx.Rollback(ctx))

	require.NoError(t, Check(ctx, db.Pool, tc))
	m, err := migrate.New(db.Pool, MigrationLine(tc))
	require.NoError(t, err)
	_, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: 3})
	require.NoError(t, err)
	require.Equal(t, 1, db.Count(t, "SELECT 1 WHERE pg_get_indexdef(to_regclass(quote_ident($1) || '.' || quote_ident($2))) NOT LIKE '%WHERE%'", tc.Schema, tc.Table+"_processed_at_idx"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = $2", tc.Schema, tc.Table+"_processed_at_non_v7_idx"))
}

// In the partitioned layout the migration leaves the table without any
// processed_at index (non-v7 ids are refused there).
func TestProcessedAtIndexNoneWhenPartitioned(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname LIKE $2", tc.Schema, tc.Table+"_processed_at%"))
	require.NoError(t, Check(context.Background(), db.Pool, tc))
}
