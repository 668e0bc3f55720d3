package retrytopic_test

import (
	"context"
	"sync"
	"testing"
	"time"

	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// runLog counts each event's runs of the handler and whether they came
// from a retry topic.
type runLog struct {
	mu   sync.Mutex
	runs map[event][]bool
}

func (l *runLog) add(ev event, onRetry bool) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.runs == nil {
		l.runs = map[event][]bool{}
	}
	l.runs[ev] = append(l.runs[ev], onRetry)
	return len(l.runs[ev])
}

func (l *runLog) get(ev event) []bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]bool(nil), l.runs[ev]...)
}

// Default trade-off: a retried event is overtaken by the later events of
// its key, which keep flowing on the main topic. Event 0 fails on the main
// topic, and on the retry path until the handler has run events 1 and 2
// (their ledger rows come first): it can only be applied once they were,
// so the order does not depend on how fast the retry copy comes back.
func TestWithoutKeyOrderLaterEventsOvertake(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, 1)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) { c.MaxAttempts = 10_000 }), nil)
	require.NoError(t, err)
	var log runLog
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t)}, func(ev event, onRetry bool) error {
		log.add(ev, onRetry)
		if ev.N == 0 && (!onRetry || len(log.get(event{Key: "k", N: 1})) == 0 || len(log.get(event{Key: "k", N: 2})) == 0) {
			return errDownstream
		}
		return nil
	})
	for n := range 3 {
		f.publish(t, f.msg("k", n))
	}
	eventually(t, func() bool { return f.rows(t, "") == 3 }, "all applied")
	require.Equal(t, []int{1, 2, 0}, f.order(t, "k"), "event 0 was applied after the later events of its key")
}

// KeyOrder: while a key has an event on the retry path, its later events
// follow it there, and are applied after it, in order. k1's first event
// recovers on its last attempt; k3's first event never does and is
// poisoned, which releases the key: its later events are applied in order.
// k2 is never held back. Every parked key is released at the end.
func TestKeyOrderLaterEventsFollowTheRetriedOne(t *testing.T) {
	t.Parallel()
	keyOrderFollows(t, false, false)
}

// The same on a *sql.DB (idem.SQLDB) for the middleware and KeyOrder, the
// handler writing through the *sql.Tx: each release commits in the
// claim's transaction, in transaction and in lease mode.
func TestKeyOrderLaterEventsFollowTheRetriedOne_SQLDB(t *testing.T) {
	t.Parallel()
	for _, lease := range []bool{false, true} {
		t.Run(map[bool]string{false: "transaction mode", true: "lease mode"}[lease], func(t *testing.T) {
			t.Parallel()
			keyOrderFollows(t, lease, true)
		})
	}
}

// The same in lease mode: each release commits in the completing
// transaction, with the claim.
func TestKeyOrderLaterEventsFollowTheRetriedOne_LeaseMode(t *testing.T) {
	t.Parallel()
	keyOrderFollows(t, true, false)
}

func keyOrderFollows(t *testing.T, lease, sqlDB bool) {
	f := newFixture(t, 2, 2)
	if sqlDB {
		db, err := idem.SQLDB(f.db.SQLDB(t, 8, nil))
		require.NoError(t, err)
		f.sqlDB = db
	}
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) {
		c.MaxAttempts = 2
		c.KeyOrder = f.keyOrder(t)
	}), nil)
	require.NoError(t, err)
	// Each release is logged with its transaction id, to compare with the
	// claim's.
	f.db.Exec(t, `CREATE TABLE release_log (event_id uuid NOT NULL, xid bigint NOT NULL)`)
	f.db.Exec(t, `CREATE FUNCTION log_release() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO release_log VALUES (OLD.event_id, txid_current() % 4294967296); RETURN OLD; END $$`)
	f.db.Exec(t, `CREATE TRIGGER log_release AFTER DELETE ON retry_parked_key FOR EACH ROW EXECUTE FUNCTION log_release()`)
	var log runLog
	poison := f.collect(t, f.poison)
	const perKey = 5
	dedup := f.newDedup(t)
	if lease {
		dedup = f.newLeaseDedup(t)
	}
	f.run(t, consumer{rt: rt, dedup: dedup}, func(ev event, onRetry bool) error {
		runs := log.add(ev, onRetry)
		if onRetry && ev.N == 0 {
			// The heads of k1 and k3 stay on the retry path until the main
			// topic has sent every later event of their keys after them,
			// however slowly the test publishes: then each of those runs
			// once, from the retry path.
			waitFollowed(t, rt, 2*(perKey-1))
		}
		switch {
		case ev.Key == "k1" && ev.N == 0 && runs <= 4: // main (2 runs) and attempt 1 (2 runs)
			return errDownstream
		case ev.Key == "k3" && ev.N == 0:
			return errDownstream
		}
		return nil
	})

	var head3 string
	for n := range perKey {
		for _, k := range []string{"k1", "k2", "k3"} {
			m := f.msg(k, n)
			if k == "k3" && n == 0 {
				head3 = m.Metadata.Get(publisher.MetadataEventID)
			}
			f.publish(t, m)
		}
	}

	eventually(t, func() bool { return f.rows(t, "") == 3*perKey-1 && poison.len() == 1 },
		"every event applied but k3's first, which is poisoned")
	require.Equal(t, []int{0, 1, 2, 3, 4}, f.order(t, "k1"), "k1's later events waited for its first")
	require.Equal(t, []int{1, 2, 3, 4}, f.order(t, "k3"), "k3's later events were applied in order after its first was poisoned")
	require.Equal(t, []int{0, 1, 2, 3, 4}, f.order(t, "k2"))
	f.eachAppliedOnce(t, 3*perKey-1)

	p := poison.byEventID()[head3]
	require.NotNil(t, p)
	require.Contains(t, p.Metadata.Get(wmiddleware.ReasonForPoisonedKey), retrytopic.ErrAttemptsExhausted.Error())
	require.Equal(t, f.main, p.Metadata.Get(wmiddleware.PoisonedTopicKey))

	for n := range perKey {
		require.NotContains(t, log.get(event{Key: "k2", N: n}), true, "k2 never went to the retry topic")
		if n > 0 {
			require.Equal(t, []bool{true}, log.get(event{Key: "k1", N: n}), "k1/%d ran once, on the retry path", n)
			require.Equal(t, []bool{true}, log.get(event{Key: "k3", N: n}), "k3/%d ran once, on the retry path", n)
		}
	}
	parked, err := retrytopic.ListParked(context.Background(), f.db.Pool, retrytopic.ParkedKeysTable{Schema: f.db.Schema}, f.group)
	require.NoError(t, err)
	require.Empty(t, parked, "every parked key was released")
	require.Equal(t, 2*perKey, f.db.Count(t, "SELECT 1 FROM release_log"))
	require.Equal(t, 2*perKey-1, f.db.Count(t, `SELECT 1 FROM release_log r JOIN processed_event p USING (event_id)
WHERE p.xmin::text = r.xid::text`), "each applied parked event was released in the transaction of its claim")
	st := rt.Stats()
	require.GreaterOrEqual(t, st.Followed, uint64(2*(perKey-1)))
	require.EqualValues(t, 2*perKey, st.Released, "each parked event released once: k1's and k3's")
	require.EqualValues(t, 1, st.Exhausted)
}

// waitFollowed waits until rt has sent n events along the retry path behind
// an earlier event of their key (Stats.Followed), for at most 90 s.
func waitFollowed(t *testing.T, rt *retrytopic.RetryTopic, n uint64) {
	deadline := time.Now().Add(90 * time.Second)
	for rt.Stats().Followed < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := rt.Stats().Followed; got < n {
		t.Errorf("%d events followed their key's head along the retry path, want %d", got, n)
	}
}
