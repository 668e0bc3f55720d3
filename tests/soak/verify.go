package soak

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// verify checks the invariants and fills the report.
func (h *harness) verify(ctx context.Context) error {
	r := h.report
	r.TerminatedBackends = int(h.terminated.Load())
	_, r.DLQReplayed = h.dlqMissing()
	r.DoublePublished = int(h.doublePublished.Load())
	r.Kills = int(h.kills.Load())
	r.Disruptions = int(h.disruptions.Load())
	r.IOTimeouts = int(h.ioTimeouts.Load())
	r.Stops, r.MaxStop = int(h.stops.Load()), time.Duration(h.maxStop.Load())
	r.ForwarderExits = int(h.forwarderExits.Load())

	var events int
	var sum int64
	if err := h.admin.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM soak_event`).Scan(&events, &sum); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if events != h.cfg.Events {
		h.violation("producer: %d business rows, want %d", events, h.cfg.Events)
	}
	// The share-group leg's poison events are never applied.
	var poison int
	var poisonSum int64
	if err := h.admin.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM soak_event WHERE fail >= $1`, poisonFail).Scan(&poison, &poisonSum); err != nil {
		return fmt.Errorf("verify: %w", err)
	}

	for _, g := range h.groups {
		if err := h.verifyGroup(ctx, g, events-poison, sum-poisonSum); err != nil {
			return err
		}
	}
	if h.cfg.Lease {
		if err := h.verifyLease(ctx); err != nil {
			return err
		}
	}
	switch {
	case h.cfg.Parallel:
		h.verifyCooperative()
	case h.cfg.Engine == EngineFranz:
		h.verifyFranz()
	}
	if n, err := h.prod.pending(ctx); err != nil || n > 0 {
		h.violation("outbox: %d rows not forwarded (%v)", n, err)
	}
	if op, ok := h.prod.(*outboxProducer); ok {
		if err := h.verifyOutbox(ctx, op, events); err != nil {
			return err
		}
	}
	h.mu.Lock()
	r.Violations = append(r.Violations, h.violations...)
	h.mu.Unlock()
	return nil
}

// verifyGroup checks consumer group g's ledger against the events (their
// count and amounts' sum), adds its report and counts the faults its live
// instances were armed with but did not execute as skipped.
func (h *harness) verifyGroup(ctx context.Context, g *group, events int, sum int64) error {
	r := h.report
	gr := GroupReport{Name: g.name, Deliveries: g.deliveries.Load(), Applied: g.applied.Load(), Duplicates: g.duplicates.Load(), Failed: g.failed.Load(),
		InProcessRetries: inProcessRetries[g.idx%len(inProcessRetries)],
		Escalated:        g.escalated.Load(), MaxAttempt: g.maxAttempt.Load(),
		RetryDeliveries: g.retryDeliveries.Load(), AppliedFromRetry: g.appliedFromRetry.Load(), Deferred: g.deferred.Load(), Poisoned: g.poisoned.Load(),
		MaxHandlers: g.maxHandlers.Load(),
	}
	g.escalatedIDs.Range(func(any, any) bool { gr.EscalatedEvents++; return true })
	if err := h.groupLedger(ctx, g, &gr); err != nil {
		return err
	}
	if h.cfg.HostileKeys {
		if err := h.verifyHostile(ctx, g, &gr); err != nil {
			return err
		}
	}
	if h.cfg.Share {
		if err := h.verifyShare(ctx, g, &gr); err != nil {
			return err
		}
	} else if n, err := h.records(h.poisonTopic(g.idx)); err != nil || n > 0 {
		h.violation("%s: %d messages on the poison topic (%v)", g.name, n, err)
	}
	r.Groups = append(r.Groups, gr)
	if gr.LedgerRows != events || gr.DistinctEvents != events {
		h.violation("%s: %d ledger rows for %d distinct events, want %d of each", g.name, gr.LedgerRows, gr.DistinctEvents, events)
	}
	if gr.Sum != sum {
		h.violation("%s: ledger sum %d, want %d", g.name, gr.Sum, sum)
	}
	for _, c := range h.groupChecks() {
		var n int
		if err := h.admin.QueryRow(ctx, c.sql, g.name).Scan(&n); err != nil {
			return fmt.Errorf("verify %s: %w", c.what, err)
		}
		if n > 0 {
			h.violation("%s: %d %s", g.name, n, c.what)
		}
	}
	g.mu.Lock()
	for _, inst := range g.live {
		if p := inst.pending.Load(); p != pendingNone {
			h.fault(h.pendingKind(p), true)
		}
	}
	g.mu.Unlock()
	return nil
}

// groupLedger reads g's failures and ledger figures into gr: the failed
// events and failures, the ledger's rows, distinct events and sum, and
// the events lost or applied twice.
func (h *harness) groupLedger(ctx context.Context, g *group, gr *GroupReport) error {
	if err := h.admin.QueryRow(ctx, `SELECT count(*), coalesce(sum(failures), 0) FROM soak_failure WHERE grp = $1`, g.name).
		Scan(&gr.FailedEvents, &gr.Failures); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if err := h.admin.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id), coalesce(sum(amount), 0) FROM soak_ledger WHERE grp = $1`, g.name).
		Scan(&gr.LedgerRows, &gr.DistinctEvents, &gr.Sum); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if err := h.admin.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM soak_event e WHERE e.fail < `+poisonFailSQL+` AND NOT EXISTS (SELECT 1 FROM soak_ledger l WHERE l.grp = $1 AND l.event_id = e.event_id)),
    (SELECT count(*) FROM (SELECT event_id FROM soak_ledger WHERE grp = $1 GROUP BY event_id HAVING count(*) > 1) x)`, g.name).
		Scan(&gr.Lost, &gr.Double); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	return nil
}

// groupCheck is a count that must be zero for a consumer group ($1).
type groupCheck struct{ what, sql string }

// groupChecks are the counts that must be zero for every group.
func (h *harness) groupChecks() []groupCheck {
	checks := []groupCheck{
		{"events never applied", `SELECT count(*) FROM soak_event e WHERE e.fail < ` + poisonFailSQL + ` AND NOT EXISTS (SELECT 1 FROM soak_ledger l WHERE l.grp = $1 AND l.event_id = e.event_id)`},
		{"events applied more than once", `SELECT count(*) FROM (SELECT event_id FROM soak_ledger WHERE grp = $1 GROUP BY event_id HAVING count(*) > 1) x`},
		{"applied events the producer never committed", `SELECT count(*) FROM soak_ledger l WHERE grp = $1 AND NOT EXISTS (SELECT 1 FROM soak_event e WHERE e.event_id = l.event_id)`},
		{"ledger rows whose data differs from the event", `SELECT count(*) FROM soak_ledger l JOIN soak_event e USING (event_id) WHERE l.grp = $1 AND (l.aggregate, l.seq, l.amount) <> (e.aggregate, e.seq, e.amount)`},
		{"events without a processed_event row", `SELECT count(*) FROM soak_event e WHERE e.fail < ` + poisonFailSQL + ` AND NOT EXISTS (SELECT 1 FROM ` + pgx.Identifier{h.table.Schema, "processed_event"}.Sanitize() + ` p WHERE p.consumer_group = $1 AND p.event_id = e.event_id)`},
		{"events that did not fail as often as planned", `SELECT count(*) FROM soak_event e LEFT JOIN soak_failure f ON f.grp = $1 AND f.event_id = e.event_id WHERE e.fail < ` + poisonFailSQL + ` AND coalesce(f.failures, 0) <> e.fail`},
		{"events left parked on the retry path (retry_parked_key rows)", `SELECT count(*) FROM ` + pgx.Identifier{h.parked.Schema, "retry_parked_key"}.Sanitize() + ` WHERE consumer_group = $1`},
		{"processed_event rows without a ledger row", `SELECT count(*) FROM ` + pgx.Identifier{h.table.Schema, "processed_event"}.Sanitize() + ` p WHERE p.consumer_group = $1 AND NOT EXISTS (SELECT 1 FROM soak_ledger l WHERE l.grp = $1 AND l.event_id = p.event_id)`},
	}
	if h.cfg.Share {
		// A share group keeps no order: each event stands alone.
		// verifyShare checks the poison events.
		return checks
	}
	return append(checks, groupCheck{"per-aggregate order breaks (seq not previous+1 in apply order)", `SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY aggregate ORDER BY applied) AS prev FROM soak_ledger WHERE grp = $1) x WHERE seq <> coalesce(prev, 0) + 1`})
}

// shareDeliveryLimit is the share groups' share.delivery.count.limit on
// the in-process broker (Kafka's default): a record is delivered at most
// that often, then archived.
const shareDeliveryLimit = 5

// checkPoisonReason checks that the poison queue took event id because
// its delivery count reached [ShareMaxDeliveries]: franz.RecordErrors's
// "delivery N of at most M failed" is in the reason.
func (h *harness) checkPoisonReason(g *group, id, line string) {
	var d, most int
	_, reason, _ := strings.Cut(line, " ")
	i := strings.Index(reason, "delivery ")
	if i < 0 {
		h.violation("%s: event %s poisoned without the delivery count in its reason: %s", g.name, id, reason)
		return
	}
	if _, err := fmt.Sscanf(reason[i:], "delivery %d of at most %d failed", &d, &most); err != nil || d < ShareMaxDeliveries || most != ShareMaxDeliveries {
		h.violation("%s: event %s poisoned at delivery %d of at most %d (%v), want from delivery %d on: %s", g.name, id, d, most, err, ShareMaxDeliveries, reason)
	}
}

// poisonFailSQL is [poisonFail] in a query.
var poisonFailSQL = strconv.Itoa(poisonFail)

// verifyShare checks the share-group leg's poison queue for g: the
// events it poisoned are exactly the planned poison events, each poisoned
// at delivery [ShareMaxDeliveries] or later (RecordErrors made the failure
// permanent: the delivery count drove it), each on the poison topic, each
// failed at least once and, one transaction per message, at most
// [shareDeliveryLimit] times per poisoning (the broker delivers a record
// no more often; it is poisoned from delivery [ShareMaxDeliveries] on,
// later when a fault interrupts the poisoning; a double publish is two
// records, poisoned twice); and reads their failure counts into gr.
func (h *harness) verifyShare(ctx context.Context, g *group, gr *GroupReport) error {
	rows, err := h.admin.Query(ctx, `SELECT e.event_id::text, coalesce(f.failures, 0) FROM soak_event e LEFT JOIN soak_failure f ON f.grp = $1 AND f.event_id = e.event_id WHERE e.fail >= $2`, g.name, poisonFail)
	if err != nil {
		return fmt.Errorf("verify poison: %w", err)
	}
	planned := map[string]int{}
	var (
		id       string
		failures int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &failures}, func() error {
		planned[id] = failures
		return nil
	}); err != nil {
		return fmt.Errorf("verify poison: %w", err)
	}
	gr.PoisonMinFailures = ShareMaxDeliveries + 1
	for id, n := range planned {
		gr.PoisonMinFailures, gr.PoisonMaxFailures = min(gr.PoisonMinFailures, n), max(gr.PoisonMaxFailures, n)
		v, ok := g.poisonedIDs.Load(id)
		if !ok {
			h.violation("%s: poison event %s (failed %d times) was not poisoned", g.name, id, n)
			continue
		}
		// In group-commit mode a delivery may run its handler more than
		// once (a batch that fails runs its messages again one by one):
		// only the failure's presence and the poisoning's delivery count
		// (checkPoisonReason) tell there.
		if lines := v.(*poisoning).all(); n < 1 || (!h.cfg.GroupCommit && n > shareDeliveryLimit*len(lines)) {
			h.violation("%s: poison event %s failed %d times, poisoned %d times, want 1 to %d failures per poisoning: %v", g.name, id, n, len(lines), shareDeliveryLimit, lines)
		}
	}
	if len(planned) == 0 {
		gr.PoisonMinFailures = 0
	}
	g.poisonedIDs.Range(func(k, v any) bool {
		gr.PoisonedEvents++
		id := k.(string)
		for _, line := range v.(*poisoning).all() {
			if _, ok := planned[id]; !ok {
				h.violation("%s: event %s poisoned, but not planned to: %s", g.name, id, line)
				return true
			}
			h.checkPoisonReason(g, id, line)
		}
		return true
	})
	if n, err := h.records(h.poisonTopic(g.idx)); err != nil || n < int64(len(planned)) {
		h.violation("%s: %d messages on the poison topic, want at least %d (%v)", g.name, n, len(planned), err)
	}
	return nil
}

// verifyOutbox checks the outbox producer's tables: exactly the oversize
// rows are dead, nothing else (no planned event waits behind them), and
// the messages table holds at least every event and every event published
// twice.
func (h *harness) verifyOutbox(ctx context.Context, op *outboxProducer, events int) error {
	r := h.report
	keys, err := op.deadKeys(ctx)
	if err != nil {
		return fmt.Errorf("verify outbox dead rows: %w", err)
	}
	want := map[string]bool{}
	for i := range int(op.oversize.Load()) {
		want[oversizeKey(i)] = true
	}
	found := map[string]bool{}
	for _, k := range keys {
		if !want[k] {
			h.violation("outbox: a row of key %s is in the dead table", k)
		}
		found[k] = true
	}
	for k := range want {
		if !found[k] {
			h.violation("outbox: the oversize row of key %s is not in the dead table", k)
		}
	}
	var rows int
	if err := h.admin.QueryRow(ctx, `SELECT count(*) FROM `+op.ob.MessagesTable(h.topic)).Scan(&rows); err != nil {
		return fmt.Errorf("verify outbox: %w", err)
	}
	r.OutboxRows = rows
	if want := events + r.DoublePublished; rows < want {
		h.violation("outbox: %d rows, want at least %d (events + published twice)", rows, want)
	}
	return nil
}

// verifyLease checks the lease-mode leg: no lease left, every event charged
// exactly once per group at the provider with one Idempotency-Key; and
// reports the takeovers and the kills that held leases.
func (h *harness) verifyLease(ctx context.Context) error {
	r := h.report
	l := &LeaseReport{Duration: h.cfg.LeaseDuration}
	r.Lease = l
	if err := h.admin.QueryRow(ctx, `SELECT count(*) FROM `+h.leaseTable()).Scan(&l.LeasesLeft); err != nil {
		return fmt.Errorf("verify leases: %w", err)
	}
	if l.LeasesLeft > 0 {
		h.violation("%d leases left in the lease table (none should outlive its event's completion)", l.LeasesLeft)
	}
	rows, err := h.admin.Query(ctx, `SELECT grp, old_owner, old_expires FROM soak_lease_takeover`)
	if err != nil {
		return fmt.Errorf("verify takeovers: %w", err)
	}
	perGroup := map[string]int{}
	killers := map[string]bool{}
	var (
		grp, owner string
		expires    time.Time
	)
	// whileLive: owner was killed (or stopped) while the lease was live.
	whileLive := func(m *sync.Map) bool {
		at, ok := m.Load(owner)
		return ok && at.(time.Time).Before(expires)
	}
	if _, err := pgx.ForEachRow(rows, []any{&grp, &owner, &expires}, func() error {
		l.Takeovers++
		perGroup[grp]++
		switch {
		case whileLive(&h.killed):
			l.TakeoversOfKilled++
			killers[owner] = true
		case whileLive(&h.stopped):
			l.TakeoversOfStopped++
		}
		return nil
	}); err != nil {
		return fmt.Errorf("verify takeovers: %w", err)
	}
	l.KillsBetweenPhases = len(killers)
	rows, err = h.admin.Query(ctx, `SELECT event_id::text FROM soak_event`)
	if err != nil {
		return fmt.Errorf("verify charges: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("verify charges: %w", err)
	}
	events := make(map[string]bool, len(ids))
	for _, id := range ids {
		events[id] = true
	}
	for i := range r.Groups {
		g := &r.Groups[i]
		g.Takeovers = perGroup[g.Name]
		var vs []string
		vs, g.Charged = h.provider.check(g.Name, events)
		for _, v := range vs {
			h.violation("provider: %s", v)
		}
	}
	var bad []string
	l.Provider, bad = h.provider.report()
	for _, b := range bad {
		h.violation("provider: %s", b)
	}
	return nil
}
