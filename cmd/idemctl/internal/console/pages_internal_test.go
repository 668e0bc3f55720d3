package console

import (
	"context"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/migrate"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/heartbeat"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// consoleFixture is a schema holding a partitioned dedup table of claims
// rows over the last 7 days (a daily partition each, 4 groups), topics
// outbox topics of 100 unforwarded rows each, and parked parked keys of 2
// events each; and a server over it whose pool counts round trips.
func consoleFixture(tb testing.TB, claims, topics, parked int) (*Server, *rtcount.Counter, *pgtest.DB) {
	tb.Helper()
	ctx := context.Background()
	db := pgtest.New(tb, 2)
	var names []string
	for i := range topics {
		names = append(names, fmt.Sprintf("topic%02d", i))
	}
	tc := deduplicator.TableConfig{Schema: db.Schema, Layout: deduplicator.LayoutPartitioned}
	pt := retrytopic.ParkedKeysTable{Schema: db.Schema}
	ocfg := outbox.Config{Schema: db.Schema}
	lines := []migrate.Line{deduplicator.MigrationLine(tc), retrytopic.MigrationLine(pt), heartbeat.MigrationLine(db.Schema)}
	for _, topic := range names {
		lines = append(lines, outbox.MigrationLine(ocfg, topic))
	}
	require.NoError(tb, migrate.Up(ctx, db.Pool, lines...))

	table := ident.Quote(db.Schema, "processed_event")
	now := time.Now().UTC()
	for d := 1; d <= 7; d++ {
		day := now.AddDate(0, 0, -d)
		from, to := partition.Bounds(day)
		db.Exec(tb, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
			ident.Quote(db.Schema, partition.Name("processed_event", day)), table, from, to))
	}
	for _, g := range []string{"billing", "shipping", "notifications", "audit"} {
		d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: g}, nil)
		require.NoError(tb, err)
		_, err = d.Register(ctx, db.Pool, "")
		require.NoError(tb, err)
	}
	// UUIDv7 ids spread over the last 7 days: 48 bits of milliseconds,
	// version 7, random bits from md5(i).
	const batch = 1_000_000
	for start := 0; start < claims; start += batch {
		n := min(batch, claims-start)
		db.Exec(tb, `INSERT INTO processed_event (event_id, consumer_group, processed_at)
SELECT (lpad(to_hex((extract(epoch FROM now()) * 1000)::bigint - (i % 604800000)), 12, '0') || '7' || substr(md5(i::text), 1, 3)
        || '8' || substr(md5(i::text), 4, 15))::uuid,
       (ARRAY['billing', 'shipping', 'notifications', 'audit'])[1 + i % 4], now()
FROM generate_series($1::bigint, $2::bigint) i`, start, start+n-1)
	}
	db.Exec(tb, `ANALYZE processed_event`)

	if parked > 0 {
		db.Exec(tb, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before, payload, metadata)
SELECT 'billing', 'key-' || (i / 2), gen_random_uuid(), 'orders.retry', now() - interval '1 minute', '{}', jsonb_build_object('retry_attempt', '1', 'retry_error', 'boom')
FROM generate_series(0, $1::int * 2 - 1) i`, parked)
	}
	for _, topic := range names {
		db.Exec(tb, fmt.Sprintf(`INSERT INTO %s (uuid, payload, metadata, transaction_id)
SELECT gen_random_uuid()::text, '{}', '{"event_id": "x"}', pg_current_xact_id() FROM generate_series(1, 100)`, ident.Quote(db.Schema, "outbox_"+topic)))
	}

	rt := &rtcount.Counter{}
	pool := db.CountingPool(tb, 2, rt)
	srv, err := New(Config{Pool: pool, Table: deduplicator.TableConfig{Schema: db.Schema, Table: "processed_event"}, Layout: "auto",
		Outbox: ocfg, Parked: pt, Forwarder: outbox.DefaultForwarderName, Refresh: 5 * time.Second})
	require.NoError(tb, err)
	return srv, rt, db
}

// get serves path and requires 200.
func (s *Server) get(tb testing.TB, path string) string {
	tb.Helper()
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Result().Body)
	require.Equal(tb, http.StatusOK, rec.Code, string(body))
	return string(body)
}

// roundTrips is the round trips of one view of path, after a first one
// (which prepares the statements).
func roundTrips(tb testing.TB, s *Server, rt *rtcount.Counter, path string) int64 {
	tb.Helper()
	s.get(tb, path)
	rt.Reset()
	s.get(tb, path)
	return rt.Load()
}

// One page view is a fixed number of queries: the same with 40,000 claims,
// 100 parked keys and 3 outbox topics as with one claim, one parked key and
// 3 topics (each outbox topic adds the same fixed few).
func TestConsolePagesMakeAFixedNumberOfQueries(t *testing.T) {
	t.Parallel()
	small, smallRT, _ := consoleFixture(t, 1, 3, 1)
	big, bigRT, _ := consoleFixture(t, 40_000, 3, 100)
	for _, path := range []string{"/", "/api/overview", "/parked", "/outbox/topic00", "/groups/billing"} {
		n := roundTrips(t, small, smallRT, path)
		require.Positive(t, n)
		require.Equal(t, n, roundTrips(t, big, bigRT, path), path)
	}
	require.Contains(t, big.get(t, "/api/overview"), `"rows_estimate": 40000`)
	// Per topic: a few queries more, the same for each.
	two, twoRT, _ := consoleFixture(t, 1, 2, 1)
	perTopic := roundTrips(t, small, smallRT, "/") - roundTrips(t, two, twoRT, "/")
	one, oneRT, _ := consoleFixture(t, 1, 1, 1)
	require.Equal(t, perTopic, roundTrips(t, two, twoRT, "/")-roundTrips(t, one, oneRT, "/"))
	t.Logf("overview: %d round trips with 3 outbox topics, %d per topic", roundTrips(t, small, smallRT, "/"), perTopic)
	// The HTML overview adds the history's two: the instances, the series.
	require.Equal(t, roundTrips(t, small, smallRT, "/api/overview")+2, roundTrips(t, small, smallRT, "/"))
}

// BenchmarkConsoleOverview serves the overview (HTML and JSON) over a dedup
// table of 10 million claims (1 million with -short), 100 parked keys and
// 10 outbox topics: ms/op and PostgreSQL round trips per view. docs/benchmarks.md
// ("The operator console") records a run. Loading the table takes minutes.
func BenchmarkConsoleOverview(b *testing.B) {
	claims := 10_000_000
	if testing.Short() {
		claims = 1_000_000
	}
	began := time.Now()
	srv, rt, _ := consoleFixture(b, claims, 10, 100)
	b.Logf("fixture: %d claims, 10 topics, 100 parked keys loaded in %s", claims, time.Since(began).Round(time.Second))
	ov := srv.c.Overview(context.Background())
	require.Empty(b, ov.Errors)
	require.InEpsilon(b, claims, ov.Dedup.RowsEstimate, 0.05, "ANALYZE's estimate") // from a sample of the rows
	b.Logf("overview: %d rows estimated, %d partitions, %s", ov.Dedup.RowsEstimate, len(ov.Dedup.Partitions), ops.HumanBytes(ov.Dedup.Bytes))
	for _, page := range []struct{ name, path string }{{"overview", "/"}, {"api-overview", "/api/overview"}, {"parked", "/parked"}} {
		path := page.path
		b.Run(page.name, func(b *testing.B) {
			srv.get(b, path)
			rt.Reset()
			for b.Loop() {
				srv.get(b, path)
			}
			b.ReportMetric(float64(rt.Load())/float64(b.N), "roundtrips/op")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/op")
		})
	}
}
