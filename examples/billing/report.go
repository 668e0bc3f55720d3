package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemkit/watermill-idempotency/tests/spantree"
)

// groupReport is what one consumer group's handler chain did. Deliveries,
// Rejected and Failed are counted by a wrapper around the dedup middleware;
// Processed and Skipped are the middleware's own counters ([idem.Dedup.Stats]),
// so the equation Deliveries = Processed + Skipped + Rejected + Failed checks
// the middleware's accounting against an outside observer: it breaks if the
// middleware acks a message it did not count, or counts one twice.
type groupReport struct {
	Deliveries int64  // calls into the dedup middleware, redeliveries included
	Processed  uint64 // handler ran and the transaction committed (Dedup.Stats)
	Skipped    uint64 // duplicates: the claim found a committed row, handler not run (Dedup.Stats)
	Rejected   int64  // returned a permanent error: to the poison topic, then acked
	Failed     int64  // returned a transient error: rolled back, nacked, delivered again
	// MiddlewareErrors are the errors the middleware counted itself: refused
	// before any SQL + rolled back + BEGIN/claim errors + (lease mode)
	// leases lost and busy. They must be Rejected + Failed.
	MiddlewareErrors uint64
	// Records is the number of distinct Kafka records (partition, offset) of
	// the topic whose delivery ended (acked or poisoned).
	Records int
	// KafkaRedelivered counts deliveries of a record that had already been
	// delivered to this group to the end: Kafka handed it out again after a
	// rebalance, because its offset had not been committed yet. The demo
	// does not inject these; the claims absorb them.
	KafkaRedelivered int
	// InFlightSkipped are the skipped duplicates that arrived while the
	// processing copy was still in flight (its transaction open).
	InFlightSkipped int
	// NoRecord counts deliveries without a Kafka partition and offset in
	// their context (none expected).
	NoRecord int64
	Claims   int // processed_event rows of the group
	Poisoned int // records of the group on the poison topic
	// PoisonedEvents is the number of distinct messages (by UUID) among them.
	PoisonedEvents int
}

// Added is Processed + Skipped + Rejected + Failed: the deliveries as the
// middleware and the errors it returned account for them.
func (g groupReport) Added() int64 {
	return int64(g.Processed) + int64(g.Skipped) + g.Rejected + g.Failed
}

// report is the outcome of a run.
type report struct {
	Orders    int
	Published int // copies the demo put on orders.confirmed: originals + injected + malformed
	// OnTopic is the number of records on orders.confirmed at the end:
	// Published, plus any batch the outbox forwarder sent twice (it is
	// at-least-once: a failed position commit resends).
	OnTopic         int
	Republished     int // injected: events published a second time
	ConcurrentSent  int // injected: copies published on every partition at once
	Malformed       int
	LostResponses   int
	Billing         groupReport
	Notification    groupReport
	Provider        providerStats
	LedgerRows      int
	Notifications   int
	ChargedOutbox   int // billing.charged.v1 rows written to the outbox
	ChargedConsumed int // distinct billing.charged.v1 event ids seen on Kafka
	Forwarded       uint64
	OutboxPruned    int64 // forwarded outbox rows deleted at the end
	PoisonReasons   []string
	// Trace is one order's trace as an indented tree (spantree.Tree):
	// TracedOrder, whose provider response was lost once (TracedLost) and
	// whose event was published twice (TracedRepublished).
	Trace             string
	TracedOrder       string
	TracedLost        bool
	TracedRepublished bool
	Elapsed           time.Duration
	Violations        []string
	// BillingEvents and BillingSeconds: phase 1's orders, and the time from
	// its first confirmation until billing had processed them all.
	BillingEvents  int
	BillingSeconds float64
	// BillingBehind is how long billing took after the last order was
	// confirmed: near zero when the producer, not billing, set the pace.
	BillingBehind float64

	// Lease mode (billing). Leases are billing's lease counters at the end.
	Leases idemLeaseStats
	// SlowOrders were charged during the provider slowdown (phase 2), in
	// SlowSeconds, while the leases were renewed SlowRenewals times; Idle is
	// what the idle-in-transaction sampler saw meanwhile, IdleLimit the
	// bound checked (0: reported only).
	SlowOrders    int
	SlowSeconds   float64
	BillingTxMode bool // billing ran in transaction mode (a negative control)
	SlowRenewals  uint64
	Idle          idleStats
	IdleLimit     time.Duration
	// Crash and Takeover describe phase 3's faults ("" when not run);
	// TakenOverInPhase is the expired leases billing took over in it.
	Crash, Takeover  string
	TakenOverInPhase uint64
	// LedgerEvents is the number of distinct event ids in the ledger;
	// LedgerEventsOnce of them have exactly one row.
	LedgerEvents, LedgerEventsOnce int
	// ProviderKeys is the number of Idempotency-Keys the provider stored
	// with a charge; ProviderKeysOnce of them were executed exactly once.
	ProviderKeys, ProviderKeysOnce int
}

// idemLeaseStats are billing's lease counters (idem.Stats).
type idemLeaseStats struct{ Taken, TakenOver, Renewed, Lost, Busy uint64 }

// Injected is the number of duplicate copies the demo published on purpose.
func (r *report) Injected() int { return r.Republished + r.ConcurrentSent }

// Resent is the number of records on orders.confirmed the demo did not
// publish: outbox rows the forwarder sent twice.
func (r *report) Resent() int { return r.OnTopic - r.Published }

// groupViolations checks what one consumer group's handler chain did: each
// event processed once, every delivery accounted for, and duplicates and
// rejections at least what the demo put on the topic (Kafka may deliver a
// record again after a rebalance; the claim absorbs it).
func groupViolations(rep *report, name string, r groupReport) []string {
	var v []string
	check := func(ok bool, format string, args ...any) {
		if !ok {
			v = append(v, name+": "+fmt.Sprintf(format, args...))
		}
	}
	check(r.Processed == uint64(rep.Orders), "handler committed %d times, want %d", r.Processed, rep.Orders)
	check(r.Deliveries == r.Added(), "deliveries %d != processed %d + skipped %d + rejected %d + failed %d = %d",
		r.Deliveries, r.Processed, r.Skipped, r.Rejected, r.Failed, r.Added())
	check(r.MiddlewareErrors == uint64(r.Rejected+r.Failed), "the middleware counted %d errors, it returned %d (rejected %d + failed %d)",
		r.MiddlewareErrors, r.Rejected+r.Failed, r.Rejected, r.Failed)
	check(r.NoRecord == 0, "%d deliveries without a Kafka partition and offset", r.NoRecord)
	check(r.Records == rep.OnTopic, "%d of the %d records on the topic were delivered to the end", r.Records, rep.OnTopic)
	check(r.Skipped >= uint64(rep.Injected()+rep.Resent()), "duplicates skipped %d, want at least %d (injected) + %d (sent twice by the forwarder)",
		r.Skipped, rep.Injected(), rep.Resent())
	check(r.Rejected >= int64(rep.Malformed), "rejected %d, want at least %d (malformed)", r.Rejected, rep.Malformed)
	// Whatever was skipped or rejected beyond the copies on the topic is a
	// record Kafka delivered again after its delivery had ended.
	beyond := int64(r.Skipped) - int64(rep.Injected()+rep.Resent()) + r.Rejected - int64(rep.Malformed)
	check(beyond == int64(r.KafkaRedelivered), "skipped and rejected exceed the copies on the topic by %d, but Kafka delivered %d records again",
		beyond, r.KafkaRedelivered)
	check(r.Poisoned == int(r.Rejected), "%d records on the poison topic, want one per rejection (%d)", r.Poisoned, r.Rejected)
	check(r.PoisonedEvents == rep.Malformed, "%d distinct messages poisoned, want the %d malformed", r.PoisonedEvents, rep.Malformed)
	return v
}

// collect reads the final counts: the handler chains', the auditors', the
// provider's and the database's.
func (d *demo) collect(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	r := d.rep
	r.Billing, r.Notification = d.billing.stats.report(), d.notification.stats.report()
	r.Billing.Poisoned, r.Notification.Poisoned = d.audit.poisoned("billing"), d.audit.poisoned("notification")
	r.Billing.PoisonedEvents, r.Notification.PoisonedEvents = d.audit.poisonedEvents("billing"), d.audit.poisonedEvents("notification")
	r.PoisonReasons = d.audit.reasons()
	r.Provider = d.provider.Stats()
	r.ChargedConsumed = d.audit.chargedCount()
	r.Forwarded = d.fwd.Stats().Forwarded
	r.LedgerRows = d.count(ctx, `SELECT count(*) FROM ledger`)
	r.Notifications = d.count(ctx, `SELECT count(*) FROM notifications`)
	r.Billing.Claims = d.count(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, d.n.billing)
	r.Notification.Claims = d.count(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, d.n.notification)
	r.ChargedOutbox = d.count(ctx, `SELECT count(*) FROM `+d.ob.MessagesTable(d.n.charged))
	st := d.billing.dedup.Stats()
	r.Leases = idemLeaseStats{Taken: st.LeasesTaken, TakenOver: st.LeasesTakenOver, Renewed: st.LeasesRenewed, Lost: st.LeasesLost, Busy: st.LeasesBusy}
	r.LedgerEvents = d.count(ctx, `SELECT count(DISTINCT event_id) FROM ledger`)
	r.LedgerEventsOnce = d.count(ctx, `SELECT count(*) FROM (SELECT event_id FROM ledger GROUP BY event_id HAVING count(*) = 1) x`)
	for _, n := range d.provider.ExecutionsPerKey() {
		r.ProviderKeys++
		if n == 1 {
			r.ProviderKeysOnce++
		}
	}
	r.IdleLimit = d.cfg.IdleInTxLimit
	r.BillingTxMode = d.cfg.billingTxMode
	if d.tracedTrace.IsValid() {
		r.TracedOrder = d.orders[d.traced].ID
		r.TracedLost = r.LostResponses > 0
		r.TracedRepublished = d.cfg.RedeliverEvery > 0 && (d.traced+1)%d.cfg.RedeliverEvery == 0
		r.Trace = spantree.Tree(d.spans.GetSpans(), d.tracedTrace)
	}
}

// checkInvariants records every broken invariant in the report's
// Violations. Exact: one charge, one ledger row, one notification, one claim
// per order and group; per group, see groupViolations.
func (d *demo) checkInvariants(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	r, check := d.rep, d.check
	N := len(d.orders)
	orders := d.count(ctx, `SELECT count(*) FROM orders`)
	check(orders == N, "orders table has %d rows, want %d", orders, N)
	check(r.Provider.Charges == N, "provider charges = %d, want one per order (%d)", r.Provider.Charges, N)
	perOrder := d.provider.ChargesPerOrder()
	for _, o := range d.orders {
		if c := perOrder[o.ID]; c != 1 {
			check(false, "order %s was charged %d times", o.ID, c)
		}
	}
	check(r.LedgerRows == N, "ledger rows = %d, want %d", r.LedgerRows, N)
	check(r.LedgerEvents == N && r.LedgerEventsOnce == N, "ledger: %d distinct events, %d of them with exactly one row, want %d and %d", r.LedgerEvents, r.LedgerEventsOnce, N, N)
	check(d.count(ctx, `SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM ledger l WHERE l.event_id = o.event_id)`) == 0, "some order events have no ledger row")
	check(r.ProviderKeys == N && r.ProviderKeysOnce == N, "provider: %d Idempotency-Keys charged, %d of them executed exactly once, want %d and %d", r.ProviderKeys, r.ProviderKeysOnce, N, N)
	for key, n := range d.provider.ExecutionsPerKey() {
		if n != 1 {
			check(false, "provider: Idempotency-Key %s executed %d times", key, n)
		}
	}
	if r.SlowOrders > 0 {
		check(r.Idle.Samples > 0, "the idle-in-transaction sampler took no sample during the slowdown")
		if r.IdleLimit > 0 {
			check(r.Idle.Max <= r.IdleLimit, "a session was idle in a transaction for %s during the provider slowdown (limit %s): %s", r.Idle.Max.Round(time.Millisecond), r.IdleLimit, r.Idle.Worst)
		}
	}
	check(d.count(ctx, `SELECT count(*) FROM (SELECT order_id FROM ledger GROUP BY order_id HAVING count(*) <> 1) x`) == 0, "some orders have more than one ledger row")
	check(d.count(ctx, `SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM ledger l WHERE l.order_id = o.id)`) == 0, "some orders have no ledger row")
	check(r.Notifications == N, "notifications = %d, want %d", r.Notifications, N)
	check(d.count(ctx, `SELECT count(*) FROM (SELECT order_id FROM notifications GROUP BY order_id HAVING count(*) <> 1) x`) == 0, "some orders have more than one notification")
	check(r.Billing.Claims == N && r.Notification.Claims == N, "processed_event rows: billing %d, notification %d, want %d each", r.Billing.Claims, r.Notification.Claims, N)
	check(r.ChargedOutbox == N, "billing.charged.v1 outbox rows = %d, want %d", r.ChargedOutbox, N)
	check(r.ChargedConsumed == N, "distinct billing.charged.v1 events on Kafka = %d, want %d", r.ChargedConsumed, N)
	check(r.OnTopic >= r.Published, "%d records on %s, but the demo published %d", r.OnTopic, d.n.orders, r.Published)
	r.Violations = append(r.Violations, groupViolations(r, "billing", r.Billing)...)
	r.Violations = append(r.Violations, groupViolations(r, "notification", r.Notification)...)
	check(r.Provider.Dropped == r.LostResponses, "provider lost %d responses, want %d", r.Provider.Dropped, r.LostResponses)
	check(r.Provider.Replayed >= r.LostResponses, "provider replayed %d stored responses, want at least %d (one per lost response)", r.Provider.Replayed, r.LostResponses)
	check(r.Provider.Mismatched == 0, "provider saw %d keys reused with a different body", r.Provider.Mismatched)
}

// printReport writes the summary table and the invariant verdict.
func printReport(w io.Writer, r *report) {
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(label string, vals ...any) {
		fmt.Fprint(tw, label, "\t")
		for _, v := range vals {
			fmt.Fprint(tw, v, "\t")
		}
		fmt.Fprintln(tw)
	}
	b, nt := r.Billing, r.Notification
	row("", "billing", "notification")
	row("events (orders confirmed)", r.Orders, r.Orders)
	row("records on orders.confirmed (+injected duplicates, +malformed)", r.OnTopic, r.OnTopic)
	row("deliveries (into the dedup middleware, all attempts)", b.Deliveries, nt.Deliveries)
	row("processed (handler committed)", b.Processed, nt.Processed)
	row("duplicates skipped (claim found)", b.Skipped, nt.Skipped)
	row("of which injected by the demo", r.Injected(), r.Injected())
	if n := r.Resent(); n > 0 {
		row("of which sent twice by the outbox forwarder", n, n)
	}
	row("of which redelivered by Kafka: skipped - injected", kafkaSkipped(r, b), kafkaSkipped(r, nt))
	row("of which met the first copy in flight", b.InFlightSkipped, nt.InFlightSkipped)
	row("rejected (permanent error, to the poison topic)", b.Rejected, nt.Rejected)
	row("failed (nothing written, nacked, delivered again)", b.Failed, nt.Failed)
	row("deliveries = processed + skipped + rejected + failed", sums(b), sums(nt))
	row("processed_event rows", b.Claims, nt.Claims)
	row("poisoned records / distinct messages", fmt.Sprintf("%d / %d", b.Poisoned, b.PoisonedEvents), fmt.Sprintf("%d / %d", nt.Poisoned, nt.PoisonedEvents))
	row("ledger rows / notifications", r.LedgerRows, r.Notifications)
	row("provider charges", r.Provider.Charges, "-")
	row("provider: requests, replayed, 409, 422", fmt.Sprintf("%d, %d, %d, %d", r.Provider.Requests, r.Provider.Replayed, r.Provider.InFlight, r.Provider.Mismatched), "-")
	row("provider responses lost after charging", r.Provider.Dropped, "-")
	row("billing.charged.v1 (outbox rows / on Kafka)", fmt.Sprintf("%d / %d", r.ChargedOutbox, r.ChargedConsumed), "-")
	row("ledger: events / with exactly one row", fmt.Sprintf("%d / %d", r.LedgerEvents, r.LedgerEventsOnce), "-")
	row("provider: Idempotency-Keys charged / executed once", fmt.Sprintf("%d / %d", r.ProviderKeys, r.ProviderKeysOnce), "-")
	row("leases: taken, taken over, renewed, lost, busy", fmt.Sprintf("%d, %d, %d, %d, %d", r.Leases.Taken, r.Leases.TakenOver, r.Leases.Renewed, r.Leases.Lost, r.Leases.Busy), "-")
	_ = tw.Flush()
	fmt.Fprintf(w, "\ninjected: %d copies published again, %d concurrent copies, %d malformed events, %d lost responses; outbox forwarded %d messages, then pruned %d rows\n",
		r.Republished, r.ConcurrentSent, r.Malformed, r.LostResponses, r.Forwarded, r.OutboxPruned)
	if n := r.Resent(); n > 0 {
		fmt.Fprintf(w, "the outbox forwarder sent %d records twice (a failed position commit resends its batch)\n", n)
	}
	fmt.Fprintf(w, "Kafka delivered %d (billing) and %d (notification) records again after they had been acked or poisoned, as consumers joined and left the groups: each was skipped by its claim (or poisoned again)\n",
		b.KafkaRedelivered, nt.KafkaRedelivered)
	if len(r.PoisonReasons) > 0 {
		fmt.Fprintln(w, "poison reasons:")
		for _, reason := range r.PoisonReasons {
			fmt.Fprintln(w, "  -", reason)
		}
	}
	if r.BillingSeconds > 0 {
		fmt.Fprintf(w, "billing throughput: %d orders in %.1fs = %.0f msg/s (idemkafka parallel subscriber), done %.1fs after the last order was confirmed\n",
			r.BillingEvents, r.BillingSeconds, float64(r.BillingEvents)/r.BillingSeconds, r.BillingBehind)
	}
	printLeaseFaults(w, r)
	printTrace(w, r)
	if len(r.Violations) == 0 {
		fmt.Fprintf(w, "\nOK: every order charged once, booked once, notified once; every malformed event poisoned (%.1fs)\n", r.Elapsed.Seconds())
		return
	}
	fmt.Fprintf(w, "\nFAILED: %d invariant(s) broken:\n  %s\n", len(r.Violations), strings.Join(r.Violations, "\n  "))
}

// printLeaseFaults writes what billing's lease mode went through: the
// provider slowdown, with the longest idle-in-transaction time seen, the
// crash and the takeover.
func printLeaseFaults(w io.Writer, r *report) {
	if r.SlowOrders > 0 {
		limit := "report only"
		if r.IdleLimit > 0 {
			limit = "limit " + r.IdleLimit.String()
		}
		mode := "billing in lease mode: no transaction during the call"
		if r.BillingTxMode {
			mode = "billing in transaction mode: its transaction open across the call"
		}
		fmt.Fprintf(w, "provider slowdown: %d charges of 1-2 s in %.1fs (%s), leases renewed %d times\n",
			r.SlowOrders, r.SlowSeconds, mode, r.SlowRenewals)
		fmt.Fprintf(w, "idle in transaction during the slowdown: max %s over %d samples every %s (%s); %s\n",
			r.Idle.Max.Round(time.Millisecond), r.Idle.Samples, idleSampleEvery, limit, r.Idle.worstOrNone())
		fmt.Fprintf(w, "  the outbox forwarder's sessions, apart: max %s idle in its position's transaction while Kafka acknowledged a batch (not bounded: its send is inside that transaction by design)\n",
			r.Idle.Forwarder.Round(time.Millisecond))
	}
	if r.Crash != "" {
		fmt.Fprintf(w, "crash: %s; its expired lease was taken over and the event completed once\n", r.Crash)
	}
	if r.Takeover != "" {
		fmt.Fprintf(w, "takeover: %s\n", r.Takeover)
	}
	if r.Crash != "" || r.SlowOrders > 0 {
		fmt.Fprintf(w, "ledger exactly once per event: %d events, %d with exactly one row; provider executed each charge once: %d keys, %d executed once\n",
			r.LedgerEvents, r.LedgerEventsOnce, r.ProviderKeys, r.ProviderKeysOnce)
	}
}

// printTrace writes the traced order's trace, indented under a caption.
func printTrace(w io.Writer, r *report) {
	if r.Trace == "" {
		return
	}
	var what []string
	if r.TracedLost {
		what = append(what, "its provider response was lost once")
	}
	if r.TracedRepublished {
		what = append(what, "its event was published twice")
	}
	about := ""
	if len(what) > 0 {
		about = " (" + strings.Join(what, ", and ") + ")"
	}
	fmt.Fprintf(w, "\nthe trace of order %s%s:\n", r.TracedOrder, about)
	fmt.Fprintln(w, "span, service, duration, dedup outcome; indented: parent → child; linked: the forwarder's batch that sent it")
	for _, line := range strings.Split(strings.TrimRight(r.Trace, "\n"), "\n") {
		fmt.Fprintln(w, "  "+line)
	}
}

// kafkaSkipped is the number of duplicates the demo did not put on the
// topic: records Kafka delivered again.
func kafkaSkipped(r *report, g groupReport) int64 {
	return int64(g.Skipped) - int64(r.Injected()+r.Resent())
}

// sums shows the deliveries equation of one group.
func sums(g groupReport) string {
	if g.Deliveries == g.Added() {
		return fmt.Sprintf("%d = %d", g.Deliveries, g.Added())
	}
	return fmt.Sprintf("%d != %d", g.Deliveries, g.Added())
}
