package deduplicator

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

func TestCleanerPlainDeletesOnlyRowsOlderThanRetention(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	retention := 7 * 24 * time.Hour
	var old, young []uuid.UUID
	for i := 0; i < 53; i++ {
		old = append(old, v7At(now.Add(-retention-time.Duration(i+1)*time.Minute)))
		young = append(young, v7At(now.Add(-retention+time.Duration(i+1)*time.Minute)))
	}
	young = append(young, v7At(now.AddDate(5, 0, 0))) // far future: kept
	insertRows(t, db.Pool, tc, "a", now, old...)
	insertRows(t, db.Pool, tc, "b", now, old[:10]...)
	insertRows(t, db.Pool, tc, "a", now, young...)
	// Non-v7 ids whose bytes sort below the boundary: inside the key range
	// the v7 pass walks, never deleted by it, and never making it loop.
	var lowV4 []uuid.UUID
	for i := 0; i < 10; i++ {
		u := uuid.New()
		u[0], u[1], u[2] = 0, 0, byte(i)
		lowV4 = append(lowV4, u)
	}
	insertRows(t, db.Pool, tc, "a", now, lowV4...)
	oldV4, youngV4 := uuid.New(), uuid.New()
	insertRows(t, db.Pool, tc, "a", now.Add(-retention-time.Hour), oldV4)
	insertRows(t, db.Pool, tc, "a", now, youngV4)

	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 7, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 63, res.Deleted)
	require.Equal(t, 11, res.Batches) // 73 rows in range: 10 full batches of 7, then one of 3
	require.False(t, res.Skipped)
	require.Positive(t, res.Duration)
	require.Equal(t, 0, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = ANY($1)", old))
	require.Equal(t, len(young), db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = ANY($1)", young))
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = ANY($1)", []uuid.UUID{oldV4, youngV4}), "non-v7 rows untouched without DeleteNonV7")
	require.Equal(t, len(lowV4), db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = ANY($1)", lowV4))

	c, err = NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, DeleteNonV7: true, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	res, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Deleted)
	require.Equal(t, 0, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = $1", oldV4))
	require.Equal(t, len(young)+1+len(lowV4), db.Count(t, "SELECT 1 FROM "+tc.Table))
}

// Two cleaners on the same table: while one works the other skips its
// pass, so exactly one of them deletes.
func TestCleanerOnlyOneInstanceWorks(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	var old []uuid.UUID
	for i := 0; i < 50; i++ {
		old = append(old, v7At(now.AddDate(0, 0, -8).Add(time.Duration(i)*time.Second)))
	}
	insertRows(t, db.Pool, tc, "g", now, old...)

	cfg := CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 10}
	a, err := NewCleaner(cfg, nil)
	require.NoError(t, err)
	b, err := NewCleaner(cfg, nil)
	require.NoError(t, err)

	inBatch, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	a.hook = func(s step, _ uint32, n int) {
		if s == stepBatch && n == 1 {
			once.Do(func() { close(inBatch) })
			<-release
		}
	}
	done := runOnceAsync(ctx, a)
	<-inBatch
	resB, err := b.RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, resB.Skipped)
	require.Zero(t, resB.Deleted)
	close(release)
	out := <-done
	require.NoError(t, out.err)
	require.False(t, out.res.Skipped)
	require.EqualValues(t, 50, out.res.Deleted)

	// The lock was released: the next pass runs (and finds nothing).
	resB, err = b.RunOnce(ctx)
	require.NoError(t, err)
	require.False(t, resB.Skipped)
	require.Zero(t, resB.Deleted)
}

// Racing without a hook: whatever the interleaving, the rows are deleted
// once and at most one pass deletes anything.
func TestCleanerConcurrentPasses(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	var old []uuid.UUID
	for i := 0; i < 2000; i++ {
		old = append(old, v7At(now.AddDate(0, 0, -9).Add(time.Duration(i)*time.Millisecond)))
	}
	insertRows(t, db.Pool, tc, "g", now, old...)
	var wg sync.WaitGroup
	results := make([]Result, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 100}, nil)
			require.NoError(t, err)
			results[i], err = c.RunOnce(ctx)
			require.NoError(t, err)
		}()
	}
	wg.Wait()
	var total int64
	workers := 0
	for _, r := range results {
		total += r.Deleted
		if r.Deleted > 0 {
			workers++
		}
	}
	require.EqualValues(t, 2000, total)
	require.Equal(t, 1, workers)
}

// A batch that hits statement_timeout (here: the table is locked by another
// transaction) makes the cleaner back off and retry with a smaller batch;
// too many in a row end the pass with ErrCleanerTimeout.
func TestCleanerBacksOffOnStatementTimeout(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	var old []uuid.UUID
	for i := 0; i < 30; i++ {
		old = append(old, v7At(now.AddDate(0, 0, -8).Add(time.Duration(i)*time.Second)))
	}
	insertRows(t, db.Pool, tc, "g", now, old...)

	lockTable := func() (release func()) {
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "LOCK TABLE "+tc.Table+" IN ACCESS EXCLUSIVE MODE")
		require.NoError(t, err)
		return func() { require.NoError(t, tx.Rollback(ctx)) }
	}

	// Gives up after MaxTimeouts.
	release := lockTable()
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, StatementTimeout: 50 * time.Millisecond, Backoff: time.Millisecond, MaxTimeouts: 2}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.ErrorIs(t, err, ErrCleanerTimeout)
	require.True(t, isStatementTimeout(err), "the server's 57014 stays in the chain")
	require.Equal(t, 2, res.Timeouts)
	require.Zero(t, res.Deleted)
	release()

	// Backs off, then completes once the lock is gone.
	release = lockTable()
	logs := &logCapture{}
	c, err = NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 1000, StatementTimeout: 50 * time.Millisecond, Backoff: 5 * time.Millisecond, MaxTimeouts: 1000}, logs)
	require.NoError(t, err)
	done := runOnceAsync(ctx, c)
	require.Eventually(t, func() bool { return logs.has("Retention batch hit statement_timeout, backing off") }, 30*time.Second, 10*time.Millisecond)
	release()
	out := <-done
	require.NoError(t, out.err)
	res = out.res
	require.Positive(t, res.Timeouts)
	require.EqualValues(t, 30, res.Deleted)
}

func TestCleanerStopsOnCancel(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	now := time.Now()
	var old []uuid.UUID
	for i := 0; i < 100; i++ {
		old = append(old, v7At(now.AddDate(0, 0, -8).Add(time.Duration(i)*time.Second)))
	}
	insertRows(t, db.Pool, tc, "g", now, old...)
	ctx, cancel := context.WithCancel(context.Background())
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 10}, nil)
	require.NoError(t, err)
	c.hook = func(s step, _ uint32, n int) {
		if s == stepBatch && n == 3 {
			cancel()
		}
	}
	res, err := c.RunOnce(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.EqualValues(t, 30, res.Deleted)
	require.Equal(t, 70, db.Count(t, "SELECT 1 FROM "+tc.Table))

	// Run returns nil on cancel; the lock is free for the next pass (at
	// once when the unlock got through; when a cancelled query took the
	// connection down, as soon as the server has ended its session).
	require.NoError(t, c.Run(ctx))
	c.hook = nil
	require.Eventually(t, func() bool {
		res, err = c.RunOnce(context.Background())
		require.NoError(t, err)
		return !res.Skipped
	}, 30*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 70, res.Deleted)
}

func TestCleanerRunLoop(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	now := time.Now()
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, Interval: 10 * time.Millisecond,
		NowFunc: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}, nil)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	id := v7At(now)
	insertRows(t, db.Pool, tc, "g", now, id)
	mu.Lock()
	now = now.AddDate(0, 0, 8)
	mu.Unlock()
	require.Eventually(t, func() bool { return db.Count(t, "SELECT 1 FROM "+tc.Table) == 0 }, 30*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
}

func TestCleanerConfigErrors(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	_, err := NewCleaner(CleanerConfig{}, nil)
	require.ErrorContains(t, err, "DB: required")
	_, err = NewCleaner(CleanerConfig{DB: db.Pool, BatchSize: -1}, nil)
	require.ErrorContains(t, err, "BatchSize")
	_, err = NewCleaner(CleanerConfig{DB: db.Pool, DeleteNonV7: true, TableConfig: TableConfig{Layout: LayoutPartitioned}}, nil)
	require.ErrorContains(t, err, "DeleteNonV7")

	// The configured layout must match the table's.
	part := tc
	part.Layout = LayoutPartitioned
	c, err := NewCleaner(CleanerConfig{TableConfig: part, DB: db.Pool}, nil)
	require.NoError(t, err)
	_, err = c.RunOnce(context.Background())
	require.True(t, errors.Is(err, ErrLayoutMismatch), "got %v", err)
}
