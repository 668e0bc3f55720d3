package soak

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// The hostile keys of the parallel legs ([Config.HostileKeys]): two
// partition keys besides the regular aggregates'.
//
//   - The hot key takes about 1 % of the events; the handler sleeps 200 to
//     500 ms on each (drawn from the seed), inside its transaction.
//   - The failing key takes about 2 %; the handler fails on its first event
//     until the soak releases it, once the event's consumer group has
//     applied [releaseShare] of the other events. Its messages skip the
//     retry-topic middleware: no retry topic, no poison topic; the error
//     nacks the message, and the parallel subscriber hands it out again
//     after its NackResendSleep, holding the key's later events behind it
//     (they wait in the partition's window, then are spilled).
//
// The main topic's subscriber runs with a PartitionWindow of
// [HostilePartitionWindow], so the failing key's waiting events fill it and
// are spilled (dropped from memory, read again from Kafka when they become
// their key's head).
const (
	// HostilePartitionWindow is the main topic's PartitionWindow with
	// [Config.HostileKeys].
	HostilePartitionWindow = 16
	// hostileAggregates is the number of hostile keys: the hot one
	// (aggregate Aggregates) and the failing one (Aggregates+1).
	hostileAggregates = 2
	hotPerMille       = 10 // share of the events of the hot key
	failingPerMille   = 20 // of the failing key
	hotSleepMin       = 200 * time.Millisecond
	hotSleepSpreadMS  = 301 // 200 to 500 ms
	// releaseShare is the share of the other events a group applies while
	// the failing key's first event fails: then the soak releases it.
	releaseShare = 0.6
)

// hotAggregate is the hot key's aggregate, -1 without hostile keys.
func hotAggregate(cfg Config) int {
	if !cfg.HostileKeys {
		return -1
	}
	return cfg.Aggregates
}

// failingAggregate is the failing key's aggregate, -1 without hostile keys.
func failingAggregate(cfg Config) int {
	if !cfg.HostileKeys {
		return -1
	}
	return cfg.Aggregates + 1
}

// keyOf is the partition key of an aggregate's events.
func keyOf(aggregate int) string { return "agg-" + strconv.Itoa(aggregate) }

// hostileKey moves an event of aggregate a to the hot key (with its sleep)
// or the failing key, or leaves it, as rh draws; a hostile key's events
// have no planned failure (the hot key would go to the retry topics, the
// failing key has its own).
func hostileKey(cfg Config, a int, rh *rand.Rand, ev *event) int {
	u := rh.IntN(1000)
	sleep := hotSleepMin + time.Duration(rh.IntN(hotSleepSpreadMS))*time.Millisecond
	switch {
	case u < hotPerMille:
		ev.fail, ev.sleep = 0, sleep
		return hotAggregate(cfg)
	case u < hotPerMille+failingPerMille:
		ev.fail = 0
		return failingAggregate(cfg)
	}
	return a
}

// soakBlockedSQL is the failing key's state per group: how often its first
// event failed, and when the soak released it.
const soakBlockedSQL = `
CREATE TABLE soak_blocked (
    grp            text PRIMARY KEY,
    failures       int  NOT NULL DEFAULT 0,
    first_failure  timestamptz,
    released_at    timestamptz,
    released_after int -- the other events the group had applied
);`

// hostileState is the harness's view of the failing key per group.
type hostileState struct {
	mu       sync.Mutex
	want     int            // other events applied before a release
	applied  map[string]int // group → other events applied, last read
	released map[string]bool
}

// plannedOf counts the plan's events of aggregate a.
func (h *harness) plannedOf(a int) (n int) {
	for _, ev := range h.plan {
		if ev.aggregate == a {
			n++
		}
	}
	return n
}

// startHostile creates the failing key's rows and releases them as the
// groups progress, until ctx ends.
func (h *harness) startHostile(ctx context.Context) error {
	if !h.cfg.HostileKeys {
		return nil
	}
	if _, err := h.admin.Exec(ctx, soakBlockedSQL); err != nil {
		return fmt.Errorf("create soak_blocked: %w", err)
	}
	h.hostile = &hostileState{
		want:    int(releaseShare * float64(h.cfg.Events-h.plannedOf(failingAggregate(h.cfg)))),
		applied: map[string]int{}, released: map[string]bool{},
	}
	for _, g := range h.groups {
		if _, err := h.admin.Exec(ctx, `INSERT INTO soak_blocked (grp) VALUES ($1)`, g.name); err != nil {
			return fmt.Errorf("insert soak_blocked: %w", err)
		}
	}
	go h.releaseBlocked(ctx)
	return nil
}

// releaseBlocked releases each group's failing key once the group has
// applied the share of the other events, and its first event failed.
func (h *harness) releaseBlocked(ctx context.Context) {
	st, failing := h.hostile, failingAggregate(h.cfg)
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for left := len(h.groups); left > 0; {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, g := range h.groups {
			st.mu.Lock()
			done := st.released[g.name]
			st.mu.Unlock()
			if done {
				continue
			}
			// The count and the release under the database gate: a failover
			// between them would release on a count of rows it undid.
			h.dbGate.RLock()
			var n int
			if err := h.admin.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM soak_ledger WHERE grp = $1 AND aggregate <> $2`, g.name, failing).Scan(&n); err != nil {
				h.dbGate.RUnlock()
				continue // a disruption: next tick
			}
			st.mu.Lock()
			st.applied[g.name] = n
			st.mu.Unlock()
			if n < st.want {
				h.dbGate.RUnlock()
				continue
			}
			var failures int
			err := h.admin.QueryRow(ctx, `UPDATE soak_blocked SET released_at = clock_timestamp(), released_after = $2 WHERE grp = $1 AND failures > 0 RETURNING failures`, g.name, n).Scan(&failures)
			h.dbGate.RUnlock()
			if err != nil {
				continue // not failed yet (no row), or a disruption
			}
			st.mu.Lock()
			st.released[g.name] = true
			st.mu.Unlock()
			left--
			h.logf("%s: failing key %s released after %d failures of its first event; the group had applied %d of the %d other events meanwhile",
				g.name, keyOf(failing), failures, n, h.cfg.Events-h.plannedOf(failing))
		}
	}
}

// blockedReason says why g is not converged yet because of the failing
// key, or "".
func (h *harness) blockedReason(g *group) string {
	st := h.hostile
	if st == nil {
		return ""
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.released[g.name] {
		return ""
	}
	return fmt.Sprintf("%s: failing key %s not released yet: %d other events applied, it is released at %d (and once its first event failed)",
		g.name, keyOf(failingAggregate(h.cfg)), st.applied[g.name], st.want)
}

// blocked fails the failing key's first event until the soak released it
// for the group. The count is kept outside the handler's transaction (on
// downPool), as the planned failures' is.
func (c *child) blocked(ctx context.Context, id uuid.UUID) error {
	var n int
	err := c.downPool.QueryRow(ctx, `UPDATE soak_blocked SET failures = failures + 1, first_failure = coalesce(first_failure, clock_timestamp())
WHERE grp = $1 AND released_at IS NULL RETURNING failures`, c.cfg.Group).Scan(&n)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil // released
	case err != nil:
		return fmt.Errorf("soak: failing key: %w", err)
	}
	return fmt.Errorf("soak: failing key: event %s fails until the soak releases it (failure %d)", id, n)
}

// HostileReport is what a group's ledger shows of the hostile keys
// ([Config.HostileKeys]).
type HostileReport struct {
	HotKey, FailingKey string
	// HotEvents and FailingEvents are the keys' planned events; HotRows and
	// FailingRows their ledger rows (each event once, in order, when the
	// run passes).
	HotEvents, HotRows, FailingEvents, FailingRows int
	// HotOverlapped counts the hot key's events during whose handler run
	// (from its ledger row to its planned sleep's end) the group applied
	// an event of another key: the others flowed around it.
	HotOverlapped int
	// BlockedFailures is how often the failing key's first event failed
	// (nacked, handed out again); AppliedBeforeHead the other events the
	// group applied before it, at least ReleaseAt.
	BlockedFailures, AppliedBeforeHead, ReleaseAt int
	// BlockedFor is from its first failure to its release.
	BlockedFor time.Duration
	// MaxSpilled is the most spilled records a process's main-topic
	// subscriber held at once (parallel.SubscriberStats.Spilled).
	MaxSpilled int64
}

// verifyHostile checks the hostile keys in g's ledger: each key's events
// applied once each and in order (the checks of every key say so too; here
// they name the key), the failing key's from the main topic only, after
// it failed and the other keys flowed around it; the hot key overlapped by
// other keys' applications; the spill path used.
func (h *harness) verifyHostile(ctx context.Context, g *group, gr *GroupReport) error {
	hot, failing := hotAggregate(h.cfg), failingAggregate(h.cfg)
	r := &HostileReport{HotKey: keyOf(hot), FailingKey: keyOf(failing), HotEvents: h.plannedOf(hot), FailingEvents: h.plannedOf(failing),
		ReleaseAt: h.hostile.want, MaxSpilled: g.maxSpilled.Load()}
	gr.Hostile = r
	for _, k := range []struct {
		name      string
		agg, want int
		rows      *int
		fromRetry bool // may be applied from a retry topic (a fault can escalate a hot event)
	}{{"hot key " + r.HotKey, hot, r.HotEvents, &r.HotRows, true}, {"failing key " + r.FailingKey, failing, r.FailingEvents, &r.FailingRows, false}} {
		var distinct, breaks, viaRetry int
		if err := h.admin.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id),
    (SELECT count(*) FROM (SELECT seq, lag(seq) OVER (ORDER BY applied) AS prev FROM soak_ledger WHERE grp = $1 AND aggregate = $2) x WHERE seq <> coalesce(prev, 0) + 1),
    count(*) FILTER (WHERE topic <> $3)
FROM soak_ledger WHERE grp = $1 AND aggregate = $2`, g.name, k.agg, h.topic).Scan(k.rows, &distinct, &breaks, &viaRetry); err != nil {
			return fmt.Errorf("verify %s: %w", k.name, err)
		}
		if *k.rows != k.want || distinct != k.want {
			h.violation("%s: %s: %d ledger rows for %d distinct events, want %d of each (lost or applied twice)", g.name, k.name, *k.rows, distinct, k.want)
		}
		if breaks > 0 {
			h.violation("%s: %s: %d order breaks (an event applied before an earlier one of its key, or twice)", g.name, k.name, breaks)
		}
		if viaRetry > 0 && !k.fromRetry {
			h.violation("%s: %s: %d events applied from a retry topic (its failures are nacked, never moved)", g.name, k.name, viaRetry)
		}
	}
	return h.verifyHostileFlow(ctx, g, r)
}

// verifyHostileFlow checks that the other keys flowed around the hostile
// ones, and that the spill path was used.
func (h *harness) verifyHostileFlow(ctx context.Context, g *group, r *HostileReport) error {
	hot, failing := hotAggregate(h.cfg), failingAggregate(h.cfg)
	var blockedFor *time.Duration
	if err := h.admin.QueryRow(ctx, `SELECT failures, released_at - first_failure FROM soak_blocked WHERE grp = $1`, g.name).Scan(&r.BlockedFailures, &blockedFor); err != nil {
		return fmt.Errorf("verify the failing key: %w", err)
	}
	if blockedFor != nil {
		r.BlockedFor = *blockedFor
	}
	if err := h.admin.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM soak_ledger WHERE grp = $1 AND aggregate <> $2
AND applied < (SELECT coalesce(min(applied), 0) FROM soak_ledger WHERE grp = $1 AND aggregate = $2 AND seq = 1)`, g.name, failing).Scan(&r.AppliedBeforeHead); err != nil {
		return fmt.Errorf("verify the failing key: %w", err)
	}
	if err := h.admin.QueryRow(ctx, `SELECT count(*) FROM soak_ledger l JOIN soak_event e USING (event_id) WHERE l.grp = $1 AND l.aggregate = $2
AND EXISTS (SELECT 1 FROM soak_ledger o WHERE o.grp = $1 AND o.aggregate <> $2 AND o.at > l.at AND o.at < l.at + e.sleep_ms * interval '1 millisecond')`, g.name, hot).Scan(&r.HotOverlapped); err != nil {
		return fmt.Errorf("verify the hot key: %w", err)
	}
	if r.BlockedFailures == 0 {
		h.violation("%s: failing key %s: its first event never failed (the leg did not run)", g.name, r.FailingKey)
	}
	if r.AppliedBeforeHead < r.ReleaseAt {
		h.violation("%s: failing key %s: only %d other events applied before its first event, want at least %d (the others did not flow around it)", g.name, r.FailingKey, r.AppliedBeforeHead, r.ReleaseAt)
	}
	if r.HotOverlapped == 0 && r.HotEvents > 0 {
		h.violation("%s: hot key %s: no other key's event was applied while one of its %d handlers ran (it held the others up)", g.name, r.HotKey, r.HotEvents)
	}
	if r.MaxSpilled == 0 {
		h.violation("%s: no main-topic subscriber spilled a record (PartitionWindow %d): the spill path was not exercised", g.name, HostilePartitionWindow)
	}
	return nil
}

// retryPath is the retry-topic middleware around the inner chain (the
// in-process Retry, the dedup middleware...), except for the failing key's
// messages ([Config.HostileKeys]): they run the inner chain alone, so that
// a failure is returned and nacks the message, which the parallel
// subscriber hands out again after its NackResendSleep, with no retry
// topic and no poison topic.
func (c *child) retryPath(inner ...message.HandlerMiddleware) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		for i := len(inner) - 1; i >= 0; i-- {
			h = inner[i](h)
		}
		withRetry := c.rt.Middleware(h)
		if c.cfg.FailingKey == "" {
			return withRetry
		}
		return func(msg *message.Message) ([]*message.Message, error) {
			if msg.Metadata.Get(publisher.MetadataPartitionKey) == c.cfg.FailingKey {
				return h(msg)
			}
			return withRetry(msg)
		}
	}
}

// watchSpill reports each new high of the main topic subscriber's spilled
// records, until ctx ends.
func (c *child) watchSpill(ctx context.Context, sub *parallel.Subscriber) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	var most int
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n := sub.Stats().Spilled; n > most {
			most = n
			c.emit(lineSpilled + strconv.Itoa(n))
		}
	}
}
