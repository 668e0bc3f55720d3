package heartbeatsql_test

import (
	"context"
	"io/fs"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/heartbeatsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func migrated(t *testing.T) *pgtest.DB {
	t.Helper()
	db := pgtest.New(t, 2)
	line := migrate.Line{Component: heartbeatsql.Component, Schema: db.Schema, Templates: []fs.FS{heartbeatsql.Migrations},
		Data: struct{ Schema string }{db.Schema}}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, line))
	return db
}

// A known set of samples gives a known series: increases between
// consecutive samples of one run, a run started within the window counted
// from zero, a restart never negative, one point per minute.
func TestSeries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t)
	// m is the start of the current minute; samples sit 10 s into minutes
	// before it. Instance a runs since two hours, restarts 5 minutes ago; b
	// starts 10 minutes ago.
	db.Exec(t, `WITH m AS (SELECT date_bin('1 minute', now(), 'epoch') AS m)
INSERT INTO idem_heartbeat (instance, started_at, at, processed, duplicates, failed, rejected, outbox_backlog)
SELECT i, m - s * interval '1 minute', m - a * interval '1 minute' + interval '10 seconds', p, d, f, r, o FROM m, (VALUES
  ('a', 120, 30, 100, 10, 1, 0, NULL), ('a', 120, 29, 160, 12, 1, 0, NULL), ('a', 120, 28, 200, 12, 4, 1, NULL),
  ('b', 10, 9.5, 5, 0, 0, 0, 7), ('b', 10, 9, 15, 1, 0, 0, 3),
  ('a', 5, 4, 3, 0, 0, 0, 40)) v(i, s, a, p, d, f, r, o)`)

	series, err := heartbeatsql.Series(ctx, db.Pool, db.Schema, time.Hour, time.Minute)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(series), 60)
	require.LessOrEqual(t, len(series), 62)
	type got struct{ ago, processed, duplicates, failed, rejected, instances int64 }
	var nonzero []got
	backlog := map[int64]int64{} // minutes ago -> the largest backlog reported
	last := series[len(series)-1].At
	for i, p := range series {
		if i > 0 {
			require.Equal(t, time.Minute, p.At.Sub(series[i-1].At))
		}
		if p.OutboxBacklog > 0 {
			backlog[int64(last.Sub(p.At)/time.Minute)] = p.OutboxBacklog
		}
		if p.Instances > 0 {
			nonzero = append(nonzero, got{int64(last.Sub(p.At) / time.Minute), p.Processed, p.Duplicates, p.Failed, p.Rejected, p.Instances})
		}
	}
	require.Equal(t, []got{
		{30, 0, 0, 0, 0, 1}, // a's first sample in the window: its run began before it
		{29, 60, 2, 0, 0, 1},
		{28, 40, 0, 3, 1, 1},
		{10, 5, 0, 0, 0, 1}, // b started within the window: from zero
		{9, 10, 1, 0, 0, 1},
		{4, 3, 0, 0, 0, 1}, // a restarted: from zero, not 3 - 200
	}, nonzero)
	require.Equal(t, map[int64]int64{10: 7, 9: 3, 4: 40}, backlog, "a gauge: the value reported, not an increase")

	short, err := heartbeatsql.Series(ctx, db.Pool, db.Schema, 10*time.Minute, 5*time.Minute)
	require.NoError(t, err)
	var sum int64
	for _, p := range short {
		sum += p.Processed
	}
	require.EqualValues(t, 15+3, sum, "b's run counts from zero, a's restart too")

	_, err = heartbeatsql.Series(ctx, db.Pool, db.Schema, time.Minute, time.Hour)
	require.Error(t, err)
}

// Beat writes a sample on the database's clock and prunes the samples older
// than keep; Instances lists each instance's last sample.
func TestBeatAndInstances(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t)
	db.Exec(t, `INSERT INTO idem_heartbeat (instance, started_at, at, processed) VALUES
('old', now() - interval '5 hours', now() - interval '3 hours', 1),
('billing-1', now() - interval '1 hour', now() - interval '10 minutes', 7)`)
	started := time.Now().Add(-time.Minute)
	backlog := int64(12)
	s := heartbeatsql.Sample{Instance: "billing-2", StartedAt: started, ConsumerGroup: "billing", Mode: "lease",
		Version: "v1.2.3", Processed: 42, Duplicates: 2, Failed: 1, Rejected: 0, OutboxBacklog: &backlog}
	require.NoError(t, heartbeatsql.Beat(ctx, db.Pool, db.Schema, s, 2*time.Hour))
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_heartbeat WHERE instance = 'old'`).Scan(&n))
	require.Zero(t, n, "older than keep: pruned")

	is, err := heartbeatsql.Instances(ctx, db.Pool, db.Schema, time.Hour)
	require.NoError(t, err)
	require.Len(t, is, 2)
	require.Equal(t, "billing-2", is[0].Instance)
	require.Equal(t, "lease", is[0].Mode)
	require.Equal(t, "v1.2.3", is[0].Version)
	require.EqualValues(t, 42, is[0].Processed)
	require.Equal(t, &backlog, is[0].OutboxBacklog)
	require.Nil(t, is[1].OutboxBacklog, "reported none")
	require.Less(t, is[0].Age, time.Minute)
	require.Equal(t, "billing-1", is[1].Instance)
	require.InDelta(t, (10 * time.Minute).Seconds(), is[1].Age.Seconds(), 60)

	recent, err := heartbeatsql.Instances(ctx, db.Pool, db.Schema, time.Minute)
	require.NoError(t, err)
	require.Len(t, recent, 1)
}
