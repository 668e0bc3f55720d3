package idemprom_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// AddTable exports the dedup table from the catalog at scrape time: rows
// (estimated), bytes, retention, partitions, and when the Cleaner last
// ran (0 before its first pass).
func TestCollectorExportsTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
	c := idemprom.NewCollector()
	c.AddTable(db.Pool, tc)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	gather := func() map[string]float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		got := map[string]float64{}
		for _, mf := range mfs {
			m := mf.GetMetric()[0]
			require.Equal(t, "table", m.GetLabel()[0].GetName())
			require.Equal(t, db.Schema+".processed_event", m.GetLabel()[0].GetValue())
			got[mf.GetName()] = m.GetGauge().GetValue()
		}
		return got
	}
	got := gather()
	require.Zero(t, got["idem_dedup_last_clean_timestamp_seconds"])
	require.Equal(t, deduplicator.DefaultRetention.Seconds(), got["idem_dedup_retention_seconds"])
	require.Positive(t, got["idem_dedup_table_bytes"])
	require.Zero(t, got["idem_dedup_partitions"])

	db.Exec(t, `INSERT INTO processed_event (event_id, consumer_group) SELECT gen_random_uuid(), 'g' FROM generate_series(1, 5)`)
	db.Exec(t, `ANALYZE processed_event`)
	cl, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: tc, DB: db.Pool}, nil)
	require.NoError(t, err)
	_, err = cl.RunOnce(ctx)
	require.NoError(t, err)
	got = gather()
	require.Equal(t, 5.0, got["idem_dedup_table_rows_estimate"])
	last := time.Unix(0, int64(got["idem_dedup_last_clean_timestamp_seconds"]*1e9))
	require.WithinDuration(t, time.Now(), last, time.Hour) // the pass's time on the database's clock
}
