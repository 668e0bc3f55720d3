package progresssql_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func setup(t *testing.T) (*pgtest.DB, string) {
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	return db, progresssql.Table(db.Schema, "processed_event")
}

// A pending write only moves a row forward, and rolls back with its
// transaction.
func TestPendingMovesForwardOnly(t *testing.T) {
	t.Parallel()
	db, table := setup(t)
	ctx := context.Background()
	write := func(commit bool, offsets ...int64) {
		p := progresssql.NewPending(table, "g")
		for _, o := range offsets {
			p.Add("t", 0, o)
		}
		p.Add("t", 1, 7)
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // after Commit: ErrTxClosed
		b := &pgx.Batch{}
		p.Queue(b)
		br := tx.SendBatch(ctx, b)
		require.NoError(t, p.Read(br))
		require.NoError(t, br.Close())
		if commit {
			require.NoError(t, tx.Commit(ctx))
		}
	}
	write(true, 4, 9, 2) // the highest of a partition wins: next 10
	write(true, 5)       // a redelivery of an older record: stays 10
	write(false, 20)     // rolled back
	rows, tl, err := progresssql.Load(ctx, db.Pool, table, "g", "")
	require.NoError(t, err)
	require.Positive(t, tl)
	require.Equal(t, []progresssql.Position{{Topic: "t", Partition: 0, Next: 10}, {Topic: "t", Partition: 1, Next: 8}}, rows)
}

// Save writes nothing, and says so, when the server is no longer on the
// timeline Load saw (a promoted standby, a restore).
func TestSaveFencedOnAnotherTimeline(t *testing.T) {
	t.Parallel()
	db, table := setup(t)
	ctx := context.Background()
	_, tl, err := progresssql.Load(ctx, db.Pool, table, "g", "t")
	require.NoError(t, err)
	pos := []progresssql.Position{{Topic: "t", Partition: 3, Next: 42, Done: "x"}}
	fenced, err := progresssql.Save(ctx, db.Pool, table, "g", tl+1, pos)
	require.NoError(t, err)
	require.True(t, fenced)
	rows, _, err := progresssql.Load(ctx, db.Pool, table, "g", "t")
	require.NoError(t, err)
	require.Empty(t, rows)
	fenced, err = progresssql.Save(ctx, db.Pool, table, "g", tl, pos)
	require.NoError(t, err)
	require.False(t, fenced)
	rows, _, err = progresssql.Load(ctx, db.Pool, table, "g", "t")
	require.NoError(t, err)
	require.Equal(t, pos, rows)
}

// Start writes a claim's start only where the partition has no row: an
// existing position is never moved, back or forward; a start without a
// committed offset (Kafka's oldest or newest, negative) is 0.
func TestStartWritesOnlyAMissingRow(t *testing.T) {
	t.Parallel()
	db, table := setup(t)
	ctx := context.Background()
	require.NoError(t, progresssql.Start(ctx, db.Pool, table, "g", "t", 0, 5))
	require.NoError(t, progresssql.Start(ctx, db.Pool, table, "g", "t", 0, 2))
	require.NoError(t, progresssql.Start(ctx, db.Pool, table, "g", "t", 0, 9))
	require.NoError(t, progresssql.Start(ctx, db.Pool, table, "g", "t", 1, -2))
	rows, _, err := progresssql.Load(ctx, db.Pool, table, "g", "t")
	require.NoError(t, err)
	require.Equal(t, []progresssql.Position{{Topic: "t", Partition: 0, Next: 5}, {Topic: "t", Partition: 1, Next: 0}}, rows)
}
