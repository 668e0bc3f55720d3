package deduplicator_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// claimDB returns a migrated test schema and a Deduplicator for group.
func claimDB(t *testing.T, group string) (*pgtest.DB, *deduplicator.Deduplicator) {
	t.Helper()
	db := pgtest.New(t, 6)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(tc)))
	d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: group}, nil)
	require.NoError(t, err)
	return db, d
}

func inTx(t *testing.T, db *pgtest.DB, fn func(tx pgx.Tx)) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	fn(tx)
	require.NoError(t, tx.Commit(ctx))
}

func TestClaimFirstThenDuplicate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	id := publisher.NewEventID()

	inTx(t, db, func(tx pgx.Tx) {
		first, err := d.Claim(ctx, tx, id)
		require.NoError(t, err)
		require.True(t, first)
		again, err := d.Claim(ctx, tx, id)
		require.NoError(t, err)
		require.False(t, again, "a second claim in the same tx is a duplicate")
	})
	inTx(t, db, func(tx pgx.Tx) {
		first, err := d.Claim(ctx, tx, id)
		require.NoError(t, err)
		require.False(t, first)
	})
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1 AND consumer_group = 'billing'", id))
}

// The claim is visible to others only when its transaction commits, and a
// rolled-back claim leaves nothing behind.
func TestClaimVisibleOnlyAfterCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	id := publisher.NewEventID()

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	first, err := d.Claim(ctx, tx, id)
	require.NoError(t, err)
	require.True(t, first)
	_, seen, err := d.ProcessedAt(ctx, db.Pool, id)
	require.NoError(t, err)
	require.False(t, seen, "uncommitted claim is invisible")
	require.NoError(t, tx.Rollback(ctx))
	_, seen, err = d.ProcessedAt(ctx, db.Pool, id)
	require.NoError(t, err)
	require.False(t, seen, "rolled-back claim is gone")

	inTx(t, db, func(tx pgx.Tx) {
		first, err := d.Claim(ctx, tx, id)
		require.NoError(t, err)
		require.True(t, first, "after a rollback the event can be claimed again")
	})
	_, seen, err = d.ProcessedAt(ctx, db.Pool, id)
	require.NoError(t, err)
	require.True(t, seen)
}

func TestClaimIsPerConsumerGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, billing := claimDB(t, "billing")
	shipping, err := deduplicator.New(deduplicator.Config{TableConfig: deduplicator.TableConfig{Schema: db.Schema}, ConsumerGroup: "shipping"}, nil)
	require.NoError(t, err)
	id := publisher.NewEventID()
	inTx(t, db, func(tx pgx.Tx) {
		for _, d := range []*deduplicator.Deduplicator{billing, shipping} {
			first, err := d.Claim(ctx, tx, id)
			require.NoError(t, err)
			require.True(t, first)
		}
	})
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id))
}

func TestClaimBatchReturnsFirstClaimsSorted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	a, b, c := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID() // a < b < c

	inTx(t, db, func(tx pgx.Tx) {
		got, err := d.ClaimBatch(ctx, tx, []uuid.UUID{b})
		require.NoError(t, err)
		require.Equal(t, []uuid.UUID{b}, got)
	})
	inTx(t, db, func(tx pgx.Tx) {
		got, err := d.ClaimBatch(ctx, tx, []uuid.UUID{c, b, a, c})
		require.NoError(t, err)
		require.Equal(t, []uuid.UUID{a, c}, got, "only new ids, sorted, each once")
		got, err = d.ClaimBatch(ctx, tx, nil)
		require.NoError(t, err)
		require.Empty(t, got)
	})
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM processed_event"))
}

// BeginClaimBatch begins the transaction and claims in one call, on a pool
// (pipelined) and inside a caller's transaction (a savepoint); the claims
// commit or vanish with the transaction.
func TestBeginClaimBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	a, b, c := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()
	inTx(t, db, func(tx pgx.Tx) {
		_, err := d.Claim(ctx, tx, b)
		require.NoError(t, err)
	})
	tx, first, err := d.BeginClaimBatch(ctx, db.Pool, pgx.TxOptions{}, []uuid.UUID{c, b, a, c})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{a, c}, first)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event"), "rolled back with the transaction")

	inTx(t, db, func(outer pgx.Tx) {
		tx, first, err := d.BeginClaimBatch(ctx, outer, pgx.TxOptions{}, []uuid.UUID{a, b})
		require.NoError(t, err)
		require.Equal(t, []uuid.UUID{a}, first)
		require.NoError(t, tx.Commit(ctx)) // releases the savepoint
	})
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event"))
}

// The batch claim reads its ids in every pgx exec mode a pool may be
// configured with: binary uuids (the extended protocol) and text ones
// (the simple protocol, a PgBouncer in transaction mode).
func TestBeginClaimBatchEveryExecMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		cfg, err := pgxpool.ParseConfig(db.URL)
		require.NoError(t, err)
		cfg.MaxConns = 1
		cfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		a, b := publisher.NewEventID(), publisher.NewEventID()
		tx, first, err := d.BeginClaimBatch(ctx, pool, pgx.TxOptions{}, []uuid.UUID{b, a})
		require.NoError(t, err, mode.String())
		require.Equal(t, []uuid.UUID{a, b}, first, mode.String())
		require.NoError(t, tx.Commit(ctx))
		tx, first, err = d.BeginClaimBatch(ctx, pool, pgx.TxOptions{}, []uuid.UUID{a, b})
		require.NoError(t, err, mode.String())
		require.Empty(t, first, mode.String())
		require.NotNil(t, first, "%s: empty, not nil, as before", mode)
		require.NoError(t, tx.Rollback(ctx))
		pool.Close()
	}
}

// Two batches sharing ids lock them in the same (sorted) order, so they can
// wait on each other but never deadlock: tx2's batch waits on tx1's first id
// before touching any later one, so tx1 can still claim a later id.
func TestClaimBatchOverlapDoesNotDeadlock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	a, b, c := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()

	tx1, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx1.Rollback(ctx) }()
	got, err := d.ClaimBatch(ctx, tx1, []uuid.UUID{c, a})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{a, c}, got)
	var pid1 int32
	require.NoError(t, tx1.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid1))

	type result struct {
		ids []uuid.UUID
		err error
	}
	done := make(chan result, 1)
	go func() {
		tx2, err := db.Pool.Begin(ctx)
		if err != nil {
			done <- result{err: err}
			return
		}
		ids, err := d.ClaimBatch(ctx, tx2, []uuid.UUID{b, c, a}) // unsorted: b first would deadlock
		if err == nil {
			err = tx2.Commit(ctx)
		} else {
			_ = tx2.Rollback(ctx)
		}
		done <- result{ids, err}
	}()
	require.Eventually(t, func() bool {
		return db.Count(t, "SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", pid1) == 1
	}, 30*time.Second, 10*time.Millisecond, "tx2 waits on tx1")

	// Had tx2 inserted b before waiting on a, this would deadlock (40P01).
	got, err = d.ClaimBatch(ctx, tx1, []uuid.UUID{b})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{b}, got)
	require.NoError(t, tx1.Commit(ctx))

	r := <-done
	require.NoError(t, r.err)
	require.Empty(t, r.ids, "every id was claimed by tx1 first")
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM processed_event"))
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	_, err := deduplicator.New(deduplicator.Config{}, nil)
	require.ErrorContains(t, err, "ConsumerGroup")
	for _, tc := range []deduplicator.TableConfig{
		{Schema: `public"; DROP TABLE users; --`},
		{Table: "processed event"},
		{Table: "1table"},
		{Schema: strings.Repeat("s", 64)},
		{Table: strings.Repeat("t", 56)}, // <table>_setting would exceed 63 bytes
		{Retention: -time.Hour},
	} {
		_, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: "g"}, nil)
		require.Error(t, err, "%+v", tc)
		require.Error(t, tc.Validate())
	}

	require.NoError(t, deduplicator.TableConfig{Table: strings.Repeat("t", 55)}.Validate())
	_, err = deduplicator.New(deduplicator.Config{ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
}

// CheckStale needs the group's registration (the middleware registers at
// start-up): without it, it refuses to guess and says so.
func TestCheckStaleNeedsTheGroupRegistered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	err := d.CheckStale(ctx, db.Pool, publisher.NewEventID(), time.Now())
	require.ErrorIs(t, err, dedupsql.ErrGroupNotFound)
	require.ErrorContains(t, err, "call Register first")
	_, err = d.Register(ctx, db.Pool, "")
	require.NoError(t, err)
	require.NoError(t, d.CheckStale(ctx, db.Pool, publisher.NewEventID(), time.Now()))
}
