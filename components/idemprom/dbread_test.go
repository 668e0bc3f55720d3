package idemprom_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// dbCollector is a registry whose collector reads an outbox backlog, a
// parked-keys table and a dedup table of db through pool.
func dbCollector(t *testing.T, db *pgtest.DB, pool *pgxpool.Pool) (*idemprom.Collector, *prometheus.Registry) {
	t.Helper()
	ctx := context.Background()
	tc := deduplicator.TableConfig{Schema: db.Schema}
	parked := retrytopic.ParkedKeysTable{Schema: db.Schema}
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc), retrytopic.MigrationLine(parked), outbox.MigrationLine(ob.Config(), "orders")))
	c := idemprom.NewCollector()
	c.AddOutboxBacklog(ob, pool, nil)
	c.AddParked(pool, parked, "billing")
	c.AddTable(pool, tc)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	return c, reg
}

// lockParked holds an ACCESS EXCLUSIVE lock on db's parked-keys table until
// the returned func is called: the parked reading waits on it.
func lockParked(t *testing.T, db *pgtest.DB) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE retry_parked_key IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { require.NoError(t, tx.Commit(ctx)) }) }
	t.Cleanup(release)
	return release
}

// waitFor polls cond (a minute at most: a hang guard, not a threshold).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "never: %s", what)
		time.Sleep(10 * time.Millisecond)
	}
}

// metricNames returns the names of the families of a gather.
func metricNames(mfs []*dto.MetricFamily) []string {
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	return names
}

// Two scrapes at once cost one read of the database: the second, arriving
// while the first waits on a lock, shares the first's result, and a scrape
// makes the same round trips as one alone.
func TestCollectorScrapesShareOneDatabaseRead(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 3)
	rt := &rtcount.Counter{}
	c, reg := dbCollector(t, db, db.CountingPool(t, 2, rt))
	_, err := reg.Gather() // connects
	require.NoError(t, err)
	rt.Reset()
	alone, err := reg.Gather()
	require.NoError(t, err)
	perScrape := rt.Load()
	require.Positive(t, perScrape)

	release := lockParked(t, db)
	rt.Reset()
	var wg sync.WaitGroup
	got := make([][]*dto.MetricFamily, 2)
	errs := make([]error, 2)
	wg.Go(func() { got[0], errs[0] = reg.Gather() })
	waitFor(t, "the first scrape waits on the lock", func() bool {
		return db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%retry_parked_key%'`, db.Schema) == 1
	})
	wg.Go(func() { got[1], errs[1] = reg.Gather() })
	waitFor(t, "the second scrape shares the read in flight", func() bool { return idemprom.DBWaiters(c) == 1 })
	release()
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, metricNames(alone), metricNames(got[0]))
	require.Equal(t, metricNames(alone), metricNames(got[1]))
	require.Equal(t, perScrape, rt.Load(), "two scrapes, one read")
	t.Logf("one scrape of a backlog, a parked table and a dedup table: %d round trips; two at once: %d", perScrape, rt.Load())
}

// A scrape's database readings share one deadline: when the parked keys'
// query outlives it, that reading fails, the table's (after it) is not
// given a deadline of its own but fails too, the backlog read before it
// is exported, and the next scrape reads again.
func TestCollectorDatabaseReadsShareOneDeadline(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 3)
	c, reg := dbCollector(t, db, db.Pool)
	idemprom.SetDBTimeout(c, 300*time.Millisecond)
	release := lockParked(t, db)
	mfs, err := reg.Gather()
	require.Error(t, err)
	require.ErrorContains(t, err, "idem_retry_parked_keys")
	require.ErrorContains(t, err, "idem_dedup_table_bytes")
	require.ErrorContains(t, err, "deadline exceeded")
	require.Contains(t, metricNames(mfs), "idem_outbox_pending_rows")

	release()
	idemprom.SetDBTimeout(c, 0)
	mfs, err = reg.Gather()
	require.NoError(t, err)
	require.Contains(t, metricNames(mfs), "idem_retry_parked_keys")
	require.Contains(t, metricNames(mfs), "idem_dedup_table_bytes")
}
