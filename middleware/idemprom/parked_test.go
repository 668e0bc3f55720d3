package idemprom_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/idemprom"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// AddParked exports the parked keys of KeyOrder as gauges, queried at
// scrape time: keys, events, the longest queue, the oldest's age, the most
// overdue first copy.
func TestCollectorExportsParkedKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	table := retrytopic.ParkedKeysTable{Schema: db.Schema}
	require.NoError(t, retrytopic.Migrate(ctx, db.Pool, table))
	c := idemprom.NewCollector()
	c.AddParked(db.Pool, table, "billing")
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	events := func() float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == "idem_retry_parked_events" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("idem_retry_parked_events not exported")
		return 0
	}
	require.Zero(t, events(), "a group without parked keys reports zeros")

	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before, parked_at) VALUES
('billing', 'a', gen_random_uuid(), 'r', now() - interval '1 minute', now() - interval '10 minutes')`)
	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, payload, metadata) VALUES
('billing', 'a', gen_random_uuid(), '', '{}'), ('billing', 'a', gen_random_uuid(), '', '{}')`)
	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before) VALUES
('billing', 'b', gen_random_uuid(), 'r', now() + interval '1 minute'), ('shipping', 'c', gen_random_uuid(), 'r', now())`)
	require.Equal(t, 4.0, events())
	n, err := testutil.GatherAndCount(reg, "idem_retry_parked_keys", "idem_retry_parked_max_queue", "idem_retry_parked_oldest_seconds", "idem_retry_parked_head_overdue_seconds")
	require.NoError(t, err)
	require.Equal(t, 4, n, "one series each, of group billing only")
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		got[mf.GetName()] = mf.GetMetric()[0].GetGauge().GetValue()
	}
	require.Equal(t, 2.0, got["idem_retry_parked_keys"])
	require.Equal(t, 3.0, got["idem_retry_parked_max_queue"])
	require.GreaterOrEqual(t, got["idem_retry_parked_oldest_seconds"], 600.0)
	require.GreaterOrEqual(t, got["idem_retry_parked_head_overdue_seconds"], 60.0)
}
