package deduplicator

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// tableSnapshot is every row of the table and every partition's name.
func tableSnapshot(t *testing.T, db *pgtest.DB, tc TableConfig) ([]string, []string) {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), "SELECT event_id::text || '/' || consumer_group || '/' || tableoid::regclass::text FROM "+tc.Table+" ORDER BY 1")
	require.NoError(t, err)
	all, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return all, partitionNames(t, db, tc)
}

func cleanedBefore(t *testing.T, db *pgtest.DB, tc TableConfig) time.Time {
	t.Helper()
	s, err := readSetting(context.Background(), db.Pool, tc)
	require.NoError(t, err)
	return s.CleanedBefore
}

// Plan on the plain layout counts exactly what the real pass then deletes,
// changes no row, records no cleanup horizon, and runs while another
// instance holds the cleaner's lock; the same Cleaner then runs the pass.
func TestCleanerPlanPlain(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	now := time.Now()
	retention := DefaultRetention
	var old, young []uuid.UUID
	for i := 0; i < 23; i++ {
		old = append(old, v7At(now.Add(-retention-time.Duration(i+1)*time.Minute)))
		young = append(young, v7At(now.Add(-retention+time.Duration(i+1)*time.Minute)))
	}
	insertRows(t, db.Pool, tc, "a", now, old...)
	insertRows(t, db.Pool, tc, "b", now, old[:5]...)
	insertRows(t, db.Pool, tc, "a", now, young...)
	insertRows(t, db.Pool, tc, "a", now.Add(-retention-time.Hour), uuid.New(), uuid.New()) // non-v7, old
	insertRows(t, db.Pool, tc, "a", now, uuid.New())                                       // non-v7, young
	before, _ := tableSnapshot(t, db, tc)

	// Another instance is working: a real pass would skip, a plan reads.
	holder, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended($1, 0))", "watermill-idempotency/retention/"+tc.Schema+"."+tc.Table)
	require.NoError(t, err)

	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, BatchSize: 4, DeleteNonV7: true, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	res, err := c.Plan(ctx)
	require.NoError(t, err)
	require.False(t, res.Skipped)
	require.EqualValues(t, 23+5+2, res.Deleted)
	require.Equal(t, retention, res.Retention)
	after, _ := tableSnapshot(t, db, tc)
	require.Equal(t, before, after, "a plan deletes nothing")
	require.True(t, cleanedBefore(t, db, tc).IsZero(), "a plan records no cleanup horizon")

	_, err = holder.Exec(ctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", "watermill-idempotency/retention/"+tc.Schema+"."+tc.Table)
	require.NoError(t, err)
	holder.Release()
	got, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.False(t, got.Skipped)
	require.Equal(t, res.Deleted, got.Deleted, "the plan counted what the pass deletes")
	require.Equal(t, len(before)-int(res.Deleted), db.Count(t, "SELECT 1 FROM "+tc.Table))
	require.False(t, cleanedBefore(t, db, tc).IsZero())
}

// Plan on the partitioned layout names the partitions a pass creates and
// drops and counts the rows it moves and deletes, exactly as the real pass
// then does, without creating, moving or dropping anything.
func TestCleanerPlanPartitioned(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	start := time.Now()
	now := start.AddDate(0, 0, 20)
	cutoff := now.Add(-DefaultRetention)
	insertRows(t, db.Pool, tc, "g", start, v7At(start.Add(time.Minute)))   // today's partition: dropped
	insertRows(t, db.Pool, tc, "g", start, v7At(start.AddDate(0, 0, -30))) // DEFAULT, far past: deleted
	insertRows(t, db.Pool, tc, "g", start, v7At(cutoff.Add(-time.Minute))) // DEFAULT, at the cutoff
	insertRows(t, db.Pool, tc, "g", start, v7At(cutoff.Add(time.Hour)))    // DEFAULT, within: moved
	insertRows(t, db.Pool, tc, "h", start, v7At(now.Add(24*time.Hour)))    // DEFAULT, ahead: moved
	insertRows(t, db.Pool, tc, "g", start, v7At(now.AddDate(1, 0, 0)))     // DEFAULT, far future: kept
	rowsBefore, partsBefore := tableSnapshot(t, db, tc)

	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return now }}, nil)
	require.NoError(t, err)
	want, err := c.Plan(ctx)
	require.NoError(t, err)
	rowsAfter, partsAfter := tableSnapshot(t, db, tc)
	require.Equal(t, rowsBefore, rowsAfter, "a plan moves and deletes nothing")
	require.Equal(t, partsBefore, partsAfter, "a plan creates and drops nothing")
	require.True(t, cleanedBefore(t, db, tc).IsZero())
	require.Len(t, want.PartitionsDropped, defaultPartitionsAhead+1, "the partitions Migrate made")
	require.GreaterOrEqual(t, len(want.PartitionsCreated), defaultPartitionsAhead+1)
	require.GreaterOrEqual(t, want.RowsMoved, int64(2))
	require.Positive(t, want.Deleted)

	got, err := c.RunOnce(ctx)
	require.NoError(t, err)
	want.Duration, got.Duration = 0, 0
	require.Equal(t, want, got, "the plan reported what the pass did")
}

func TestProcessedAt(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	d, err := New(Config{TableConfig: tc, ConsumerGroup: "billing"}, nil)
	require.NoError(t, err)
	id, other := v7At(time.Now()), v7At(time.Now())
	var txStart time.Time
	require.NoError(t, pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		require.NoError(t, tx.QueryRow(ctx, "SELECT now()").Scan(&txStart))
		_, err := d.Claim(ctx, tx, id)
		return err
	}))
	at, ok, err := d.ProcessedAt(ctx, db.Pool, id)
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, at.Equal(txStart), "processed_at is the claim's transaction start")
	_, ok, err = d.ProcessedAt(ctx, db.Pool, other)
	require.NoError(t, err)
	require.False(t, ok)
	d2, err := New(Config{TableConfig: tc, ConsumerGroup: "shipping"}, nil)
	require.NoError(t, err)
	_, ok, err = d2.ProcessedAt(ctx, db.Pool, id)
	require.NoError(t, err)
	require.False(t, ok, "per consumer group")

	missing, err := New(Config{TableConfig: TableConfig{Schema: tc.Schema, Table: "nope"}, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	_, _, err = missing.ProcessedAt(ctx, db.Pool, id)
	require.ErrorIs(t, err, ErrTableMissing)
}

func TestInspectPartitioned(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPartitioned)
	ctx := context.Background()
	start := time.Now()
	today := partition.UTCDay(start)

	info, err := dedupsql.Inspect(ctx, db.Pool, tc.Schema, "")
	require.NoError(t, err)
	require.Equal(t, LayoutPartitioned.String(), info.Layout)
	parts := info.Partitions
	require.Len(t, parts, defaultPartitionsAhead+2)
	for i := 0; i <= defaultPartitionsAhead; i++ {
		p := parts[i]
		day := today.AddDate(0, 0, i)
		require.Equal(t, partition.Name(tc.Table, day), p.Name)
		require.False(t, p.Default)
		require.True(t, p.From.Equal(day), "%s from %s", p.Name, p.From)
		require.True(t, p.To.Equal(day.AddDate(0, 0, 1)))
		require.Contains(t, p.Bound, "FOR VALUES FROM")
		require.Positive(t, p.Bytes)
	}
	def := parts[len(parts)-1]
	require.Equal(t, partition.DefaultName(tc.Table), def.Name)
	require.True(t, def.Default)
	require.True(t, def.From.IsZero())
	require.Equal(t, "DEFAULT", def.Bound)

	t1 := start.Truncate(time.Microsecond)
	insertRows(t, db.Pool, tc, "a", t1, v7At(start), v7At(start))
	insertRows(t, db.Pool, tc, "a", t1, v7At(start.AddDate(0, 0, 1)))
	insertRows(t, db.Pool, tc, "b", t1, v7At(start.AddDate(0, 0, 30))) // DEFAULT

	// From the catalog, without reading a row.
	_, err = db.Pool.Exec(ctx, "ANALYZE "+tc.Schema+"."+tc.Table)
	require.NoError(t, err)
	info, err = dedupsql.Inspect(ctx, db.Pool, tc.Schema, tc.Table)
	require.NoError(t, err)
	require.Equal(t, LayoutPartitioned.String(), info.Layout)
	require.Equal(t, DefaultRetention, info.Retention)
	require.True(t, info.CleanedBefore.IsZero())
	require.EqualValues(t, 4, info.RowsEstimate) // an ANALYZE of 4 rows counts them all
	require.Positive(t, info.Bytes)
	require.Len(t, info.Partitions, len(parts))
	c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	info, err = dedupsql.Inspect(ctx, db.Pool, tc.Schema, tc.Table)
	require.NoError(t, err)
	require.False(t, info.CleanedBefore.IsZero(), "%+v", res)
	require.WithinDuration(t, time.Now(), info.CleanedBefore.Add(info.Retention), time.Hour) // the pass's time, on the database's clock
}

func TestInspectPlain(t *testing.T) {
	t.Parallel()
	db, tc := retentionDB(t, LayoutPlain)
	ctx := context.Background()
	info, err := dedupsql.Inspect(ctx, db.Pool, tc.Schema, tc.Table)
	require.NoError(t, err)
	require.Equal(t, LayoutPlain.String(), info.Layout)
	require.Empty(t, info.Partitions)
	require.Positive(t, info.Bytes) // the empty table's indexes

	_, err = dedupsql.Inspect(ctx, db.Pool, tc.Schema, "nope")
	require.ErrorIs(t, err, ErrTableMissing)
	_, err = dedupsql.Inspect(ctx, db.Pool, tc.Schema, `bad name"; DROP TABLE processed_event; --`)
	require.ErrorIs(t, err, ErrTableMissing, "a name is quoted, never run")
}

// Status lists every version applied or pending, and the versions recorded
// for the table that the migrator does not know.
func TestMigratorStatus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	plain := TableConfig{Schema: db.Schema}
	m, err := migrate.New(db.Pool, MigrationLine(plain))
	require.NoError(t, err)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, []migrate.MigrationStatus{
		{Component: "processed_event:processed_event", Version: 1, Name: "processed_event"},
		{Component: "processed_event:processed_event", Version: 2, Name: "retention_and_groups"},
		{Component: "processed_event:processed_event", Version: 3, Name: "lease"},
		{Component: "processed_event:processed_event", Version: 4, Name: "processed_at_index_non_v7"},
		{Component: "processed_event:processed_event", Version: 5, Name: "progress"},
	}, st)

	_, err = m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 1})
	require.NoError(t, err)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.True(t, st[0].Applied)
	require.WithinDuration(t, time.Now(), st[0].AppliedAt, time.Hour)
	require.False(t, st[1].Applied)
	require.True(t, st[1].AppliedAt.IsZero())

	require.NoError(t, migrate.Up(ctx, db.Pool, MigrationLine(TableConfig{Schema: db.Schema, Layout: LayoutPartitioned})))
	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.Len(t, st, 6)
	require.True(t, st[4].Applied)
	require.Equal(t, migrate.MigrationStatus{Component: "processed_event:processed_event", Version: 100, Name: "partition_by_event_id", Applied: true, AppliedAt: st[5].AppliedAt, Unknown: true}, st[5],
		"the plain migrator does not know the partitioned layout's version")
}
