package deduplicator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func TestUUIDv7FloorAndBounds(t *testing.T) {
	t.Parallel()
	day := time.Date(2026, 3, 14, 0, 0, 0, 0, time.UTC)
	lastMs := day.Add(-time.Millisecond) // 23:59:59.999 of the day before

	from, to := partition.Bounds(day.Add(13 * time.Hour))
	require.Equal(t, partition.Floor(day), from)
	require.Equal(t, partition.Floor(day.AddDate(0, 0, 1)), to)
	require.Equal(t, "019ce9a4-8800-7000-8000-000000000000", from.String())
	require.Equal(t, uint8(7), uint8(from.Version()))

	// The largest id of 23:59:59.999 is below the bound, the smallest of
	// 00:00:00.000 is the bound itself.
	maxLate := v7AtMax(lastMs)
	require.Negative(t, bytes.Compare(maxLate[:], from[:]))
	require.Equal(t, from, partition.Floor(day))
	require.Equal(t, "t_p20260313", partition.Name("t", lastMs))
	require.Equal(t, "t_p20260314", partition.Name("t", day))
	require.Equal(t, "t_p20260314", partition.Name("t", day.In(time.FixedZone("x", -5*3600)))) // UTC days

	ts, ok := partition.Time(v7At(lastMs))
	require.True(t, ok)
	require.True(t, ts.Equal(lastMs))
	_, ok = partition.Time(uuid.New())
	require.False(t, ok)
}

func TestPartitionedBoundaryRowsLandInTheirDay(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	today := partition.UTCDay(time.Now())
	tomorrow := today.AddDate(0, 0, 1)

	late := v7AtMax(tomorrow.Add(-time.Millisecond)) // today 23:59:59.999, max random bits
	early := partition.Floor(tomorrow)               // tomorrow 00:00:00.000, min random bits
	d, err := New(Config{TableConfig: tc, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	for _, id := range []uuid.UUID{late, early} {
		first, err := d.Claim(ctx, db.Pool, id)
		require.NoError(t, err)
		require.True(t, first)
	}
	require.Equal(t, partition.Name(tc.Table, today), partitionOf(t, db, tc, late))
	require.Equal(t, partition.Name(tc.Table, tomorrow), partitionOf(t, db, tc, early))
}

func TestPartitionedMigrateCreatesDaysAheadAndDefault(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	today := partition.UTCDay(time.Now())
	want := []string{tc.Table + "_default"}
	for i := 0; i <= defaultPartitionsAhead; i++ {
		want = append(want, partition.Name(tc.Table, today.AddDate(0, 0, i)))
	}
	require.ElementsMatch(t, want, partitionNames(t, db, tc))
	// Idempotent.
	require.NoError(t, migrate.Up(context.Background(), db.Pool, MigrationLine(tc)))
	require.ElementsMatch(t, want, partitionNames(t, db, tc))
}

func TestCleanerPartitionedCreatesAheadAndDropsOld(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	start := time.Now()
	today := partition.UTCDay(start)
	old := v7At(today.Add(time.Hour))
	insertRows(t, db.Pool, tc, "g", start, old)

	// Ten days later, with a 7-day retention.
	now := start.AddDate(0, 0, 10)
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)

	// Migrate made today..today+3; those wholly before now-7d are dropped.
	boundary := partition.Floor(now.Add(-DefaultRetention))
	want := []string{tc.Table + "_default"}
	dropped := 0
	for i := 0; i <= defaultPartitionsAhead; i++ {
		d := today.AddDate(0, 0, i)
		if _, to := partition.Bounds(d); bytes.Compare(to[:], boundary[:]) > 0 {
			want = append(want, partition.Name(tc.Table, d))
		} else {
			dropped++
		}
		want = append(want, partition.Name(tc.Table, partition.UTCDay(now).AddDate(0, 0, i)))
	}
	require.ElementsMatch(t, want, partitionNames(t, db, tc))
	require.Len(t, res.PartitionsCreated, 4) // now .. now+3
	require.Len(t, res.PartitionsDropped, dropped)
	require.Positive(t, dropped)
	require.Zero(t, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE event_id = $1", old))

	// A second pass has nothing to do.
	res, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Empty(t, res.PartitionsCreated)
	require.Empty(t, res.PartitionsDropped)
}

// An event redelivered after its neighbours' partitions were created and
// dropped is still a duplicate; a far-future id lands in the DEFAULT
// partition, is moved into its own partition once that day is near, and
// stays a duplicate throughout.
func TestPartitionedDedupSurvivesMaintenance(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	start := time.Now()
	d, err := New(Config{TableConfig: tc, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	claim := func(id uuid.UUID) bool {
		t.Helper()
		first, err := d.Claim(ctx, db.Pool, id)
		require.NoError(t, err)
		return first
	}

	recent := v7At(start.Add(-time.Minute))
	yesterday := v7At(start.AddDate(0, 0, -1))  // no partition yet: DEFAULT
	future := v7At(start.AddDate(0, 0, 20))     // far future: DEFAULT
	twoDaysAgo := v7At(start.AddDate(0, 0, -2)) // DEFAULT
	for _, id := range []uuid.UUID{recent, yesterday, future, twoDaysAgo} {
		require.True(t, claim(id))
	}
	def := tc.Table + "_default"
	require.Equal(t, def, partitionOf(t, db, tc, future))
	require.Equal(t, def, partitionOf(t, db, tc, yesterday))

	now := start
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Len(t, res.PartitionsCreated, 2, "yesterday and two days ago get their partitions")
	require.EqualValues(t, 2, res.RowsMoved)
	require.Equal(t, partition.Name(tc.Table, start.AddDate(0, 0, -1)), partitionOf(t, db, tc, yesterday))
	require.Equal(t, def, partitionOf(t, db, tc, future))
	for _, id := range []uuid.UUID{recent, yesterday, future, twoDaysAgo} {
		require.False(t, claim(id), "redelivery after partitions were created must be a duplicate")
	}

	// 18 days later: the future day is within the ahead window, its row is
	// moved; the old partitions are dropped.
	now = start.AddDate(0, 0, 18)
	res, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.RowsMoved)
	require.NotEmpty(t, res.PartitionsDropped)
	require.Equal(t, partition.Name(tc.Table, start.AddDate(0, 0, 20)), partitionOf(t, db, tc, future))
	require.False(t, claim(future), "redelivery after its neighbours were dropped must be a duplicate")
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM "+tc.Table))
}

// Claims of ids spread over many days (some in the DEFAULT partition) run
// while passes create, move and drop partitions. Each id is claimed by two
// workers, retrying errors (a claim that waited on a moved DEFAULT row
// fails with 23514 and is retried, as the router would): every id must be
// claimed first exactly once and end with exactly one row.
func TestPartitionMaintenanceRacesClaims(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	start := time.Now()
	d, err := New(Config{TableConfig: tc, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)

	var ids []uuid.UUID
	for i := 0; i < 300; i++ {
		ids = append(ids, v7At(start.Add(time.Duration(i%12-3)*24*time.Hour+time.Duration(i)*time.Second)))
	}
	var mu sync.Mutex
	now := start
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, tc.Schema, tc.Table, 30*24*time.Hour))
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: clock, LockRetries: 50}, nil)
	require.NoError(t, err)
	// Old partitions for the first racing pass to drop.
	now = start.AddDate(0, 0, -35)
	_, err = c.RunOnce(ctx)
	require.NoError(t, err)
	now = start

	stop := make(chan struct{})
	var passes sync.WaitGroup
	passes.Add(1)
	var passErr error
	var total Result
	go func() {
		defer passes.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			res, err := c.RunOnce(ctx)
			if err != nil {
				passErr = err
				return
			}
			total.Batches++
			total.PartitionsCreated = append(total.PartitionsCreated, res.PartitionsCreated...)
			total.PartitionsDropped = append(total.PartitionsDropped, res.PartitionsDropped...)
			total.RowsMoved += res.RowsMoved
			mu.Lock()
			now = now.Add(12 * time.Hour) // a new ahead day every other pass
			mu.Unlock()
		}
	}()

	var firsts sync.Map
	var retried sync.Map
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := range ids {
				id := ids[(i+w*75)%len(ids)]
				for attempt := 0; ; attempt++ {
					first, err := d.Claim(ctx, db.Pool, id)
					if err == nil {
						if first {
							n, _ := firsts.LoadOrStore(id, new(int))
							mu.Lock()
							*n.(*int)++
							mu.Unlock()
						}
						break
					}
					var pgErr *pgconn.PgError
					require.True(t, errors.As(err, &pgErr) && pgErr.Code == pgerrcode.CheckViolation, "unexpected claim error: %v", err)
					retried.Store(id, true)
					require.Less(t, attempt, 100)
				}
			}
		}(w)
	}
	wg.Wait()
	close(stop)
	passes.Wait()
	require.NoError(t, passErr)
	nRetried := 0
	retried.Range(func(any, any) bool { nRetried++; return true })
	t.Logf("passes %d, partitions created %d, dropped %d, rows moved %d, ids whose claim was retried %d",
		total.Batches, len(total.PartitionsCreated), len(total.PartitionsDropped), total.RowsMoved, nRetried)
	require.NotEmpty(t, total.PartitionsCreated)
	require.NotEmpty(t, total.PartitionsDropped)

	for _, id := range ids {
		n, ok := firsts.Load(id)
		require.True(t, ok, "id %s never claimed first", id)
		require.Equal(t, 1, *n.(*int), "id %s claimed first more than once", id)
	}
	require.Equal(t, len(ids), db.Count(t, "SELECT DISTINCT event_id FROM "+tc.Table))
	require.Equal(t, len(ids), db.Count(t, "SELECT 1 FROM "+tc.Table))
}

func TestMigratePlainToPartitionedKeepsEveryRow(t *testing.T) {
	t.Parallel()
	db, plain := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	var ids []uuid.UUID
	for i := -40; i < 40; i++ { // 40 days back, today, far future
		for j := 0; j < 5; j++ {
			ids = append(ids, v7At(now.Add(time.Duration(i)*24*time.Hour+time.Duration(j)*time.Minute)))
		}
	}
	ids = append(ids, v7At(time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)), v7At(time.Date(2200, 1, 1, 0, 0, 0, 0, time.UTC)))
	insertRows(t, db.Pool, plain, "a", now, ids...)
	insertRows(t, db.Pool, plain, "b", now, ids[:10]...)
	snapshot := func() []string {
		rows, err := db.Pool.Query(ctx, "SELECT event_id::text || '/' || consumer_group || '/' || processed_at::text FROM "+plain.Table+" ORDER BY 1")
		require.NoError(t, err)
		var out []string
		for rows.Next() {
			var s string
			require.NoError(t, rows.Scan(&s))
			out = append(out, s)
		}
		require.NoError(t, rows.Err())
		return out
	}
	before := snapshot()
	require.Len(t, before, len(ids)+10)

	part := plain
	part.Layout = LayoutPartitioned
	require.NoError(t, migrate.Up(ctx, db.Pool, MigrationLine(part)))
	require.Equal(t, before, snapshot())
	var kind string
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", plain.Table).Scan(&kind))
	require.Equal(t, "p", kind)
	require.Equal(t, partition.Name(part.Table, now.AddDate(0, 0, -39)), partitionOf(t, db, part, ids[5]))
	require.Equal(t, part.Table+"_default", partitionOf(t, db, part, ids[len(ids)-1]))
	// Rows outside every daily partition (far future) are still deduped.
	dd, err := New(Config{TableConfig: part, ConsumerGroup: "a"}, nil)
	require.NoError(t, err)
	for _, id := range []uuid.UUID{ids[0], ids[len(ids)-1], ids[len(ids)/2]} {
		first, err := dd.Claim(ctx, db.Pool, id)
		require.NoError(t, err)
		require.False(t, first)
	}

	// And back, still keeping every row.
	migs, err := renderMigrations(part)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, migs[len(migs)-1].Down)
	require.NoError(t, err)
	require.Equal(t, before, snapshot())
}

func TestMigrateToPartitionedRefusesNonV7Rows(t *testing.T) {
	t.Parallel()
	db, plain := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	insertRows(t, db.Pool, plain, "g", time.Now(), v7At(time.Now()), uuid.New())
	part := plain
	part.Layout = LayoutPartitioned
	err := migrate.Up(ctx, db.Pool, MigrationLine(part))
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "got %v", err)
	require.Equal(t, pgerrcode.CheckViolation, pgErr.Code)
	require.Contains(t, pgErr.Message, "1 rows")
	var kind string
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", plain.Table).Scan(&kind))
	require.Equal(t, "r", kind, "nothing changed")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM "+plain.Table))
}

func TestLayoutValidation(t *testing.T) {
	t.Parallel()
	long := fmt.Sprintf("%054d", 0)
	long = "t" + long[1:]
	require.Error(t, TableConfig{Schema: "s", Table: long, Layout: LayoutPartitioned}.Validate())
	require.NoError(t, TableConfig{Schema: "s", Table: long, Layout: LayoutPlain}.Validate())
	require.Error(t, TableConfig{Schema: "s", Table: "t", Layout: Layout(9)}.Validate())
}

// A partition drop needs the parent's ACCESS EXCLUSIVE lock, which waits for
// every open claim transaction. With lock_timeout it gives up quickly
// (so claims queued behind it are not held for long) and retries; after
// LockRetries attempts the pass fails with the server's 55P03.
func TestPartitionDropRetriesOnLockTimeout(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	d, err := New(Config{TableConfig: tc, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	openClaim := func() (commit func()) {
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		first, err := d.Claim(ctx, tx, v7At(time.Now()))
		require.NoError(t, err)
		require.True(t, first)
		return func() { require.NoError(t, tx.Commit(ctx)) }
	}
	later := time.Now().AddDate(0, 0, 10) // today's partitions are then wholly old

	commit := openClaim()
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return later },
		LockTimeout: 20 * time.Millisecond, LockRetries: 2}, nil)
	require.NoError(t, err)
	_, err = c.RunOnce(ctx)
	require.True(t, isLockTimeout(err), "got %v", err)
	require.ErrorContains(t, err, "attempt 2")
	commit()

	commit = openClaim()
	logs := &logCapture{}
	c, err = NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return later },
		LockTimeout: 20 * time.Millisecond, LockRetries: 10_000}, logs)
	require.NoError(t, err)
	done := runOnceAsync(ctx, c)
	require.Eventually(t, func() bool { return logs.has("Partition DDL hit lock_timeout, retrying") }, 30*time.Second, 5*time.Millisecond)
	commit()
	out := <-done
	require.NoError(t, out.err)
	res := out.res
	require.NotEmpty(t, res.PartitionsDropped)
	require.Equal(t, 0, db.Count(t, "SELECT 1 FROM "+tc.Table), "the claim's partition was old and is gone")
}

// A young consumer group (first seen less than a retention ago) lets old
// events through its stale guard, so a partition holding its claims is kept
// although it is wholly older than the retention; the claims of old groups
// in the DEFAULT partition are deleted, the young group's are kept.
func TestCleanerKeepsYoungGroupsClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tc := retentionDB(t, LayoutPartitioned)
	now := time.Now()
	oldDay := partition.UTCDay(now.AddDate(0, 0, -10))
	from, to := partition.Bounds(oldDay)
	db.Exec(t, "CREATE TABLE "+partition.Name(tc.Table, oldDay)+" PARTITION OF "+tc.Table+" FOR VALUES FROM ('"+from.String()+"') TO ('"+to.String()+"')")
	emptyDay := oldDay.AddDate(0, 0, -1)
	from, to = partition.Bounds(emptyDay)
	db.Exec(t, "CREATE TABLE "+partition.Name(tc.Table, emptyDay)+" PARTITION OF "+tc.Table+" FOR VALUES FROM ('"+from.String()+"') TO ('"+to.String()+"')")

	young, err := New(Config{TableConfig: tc, ConsumerGroup: "young"}, nil)
	require.NoError(t, err)
	_, err = young.Register(ctx, db.Pool, "")
	require.NoError(t, err)
	inPartition := v7At(oldDay.Add(time.Hour))
	inDefault := v7At(now.AddDate(0, 0, -40))
	insertRows(t, db.Pool, tc, "young", now, inPartition, inDefault)
	insertRows(t, db.Pool, tc, "veteran", now, v7At(now.AddDate(0, 0, -41)))

	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"young"}, res.YoungGroups)
	require.Len(t, res.PartitionsKept, 1, "the young group's partition")
	require.Len(t, res.PartitionsDropped, 1, "the empty old partition")
	require.EqualValues(t, 1, res.Deleted, "the veteran's row in DEFAULT")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE consumer_group = 'young'"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM "+tc.Table+" WHERE consumer_group = 'veteran'"))
}
