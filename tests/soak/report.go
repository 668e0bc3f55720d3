package soak

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Report is the outcome of a run.
type Report struct {
	Seed    uint64
	Events  int
	Elapsed time.Duration
	// Producer is "outbox+forwarder" or "kafka" (direct publish).
	Producer string
	// Consumers is "one transaction per message" or "group commit", with
	// ", parallel subscriber" in [Config.Parallel] mode and ", hostile
	// keys (PartitionWindow 16)" with [Config.HostileKeys].
	Consumers string
	// Faults counts injected faults by kind; Skipped those that found no
	// target, or were armed in a consumer but not executed before the run
	// ended. Every scheduled fault is in one or the other.
	Faults  map[string]int
	Skipped map[string]int
	// Scheduled counts the faults the schedule planned, by kind (a join
	// plans its leave; a pg-terminate-producer is reported under the name
	// of the component it hit, pg-terminate-producer or -forwarder).
	Scheduled map[string]int
	// Kills counts consumer processes killed with SIGKILL (all kinds);
	// Disruptions the database outages (every connection dropped, new ones
	// refused for Outage).
	Kills, Disruptions int
	Outage             time.Duration
	// TerminatedBackends counts PostgreSQL backends killed by
	// pg_terminate_backend (the pg-terminate faults and the disruptions).
	TerminatedBackends int
	// IOTimeouts counts "i/o timeout" errors in the consumers' logs: a
	// consumer group that cannot re-form logs one per member per
	// Net.ReadTimeout.
	IOTimeouts int
	// Stops counts consumer processes ended with SIGTERM, MaxStop the
	// longest of them from the signal to the process's exit: bounded by
	// the consumers' timeouts (idemkafka's RevokeTimeout, the router's
	// CloseTimeout), or a violation (see [MaxStopWait]).
	Stops   int
	MaxStop time.Duration
	// ForwarderExits counts forwarders that stopped on an error (and were
	// started again).
	ForwarderExits int
	// Database is the run's database, when kept.
	Database string
	// OutboxRows is the number of outbox rows written (all forwarded when
	// the run passes); 0 with DirectPublish.
	OutboxRows int
	// DLQReplayed counts the events copied to the dead-letter topic (and
	// replayed), DoublePublished the events published twice.
	DLQReplayed     int
	DoublePublished int
	// RetryEvents are the events planned to fail transiently (in each
	// group), RetryFailures the failures planned for them in all
	// ([Config.RetryPercent]).
	RetryEvents, RetryFailures int
	// PoisonEvents are the share-group leg's events planned to fail on
	// every delivery ([SharePoisonPercent], [Config.Share]): each group's
	// poison queue must take each of them, at delivery
	// [ShareMaxDeliveries]; they are not in the ledger.
	PoisonEvents int
	// Rebalance says, in [Config.Parallel] mode, which rebalance protocol
	// the consumers' groups ran (checked: cooperative-sticky).
	Rebalance string
	// Per consumer group.
	Groups []GroupReport
	// Lease is the lease-mode leg's view; nil in the other modes.
	Lease *LeaseReport
	// Failover is the failover fault's view; nil in a run without it.
	Failover *FailoverReport
	// Violations of the invariants; empty means the run passed.
	Violations []string
}

// LeaseReport is what a lease-mode run ([Config.Lease]) saw of the leases
// and of the fake provider.
type LeaseReport struct {
	Duration time.Duration
	// Takeovers counts the leases taken over after they expired (a trigger
	// on the lease table logs each change of token, with the owner it was
	// taken from and the expiry it had). TakeoversOfKilled are those still
	// live when their owner was SIGKILLed: each is a delivery killed
	// between its phases (its lease taken, its completion not committed),
	// and KillsBetweenPhases counts the kills that left at least one such
	// lease behind (the armed after-call and mid-call kills always do; a
	// random or after-commit kill when the process had other deliveries in
	// flight). TakeoversOfStopped are those still live when their owner
	// was stopped with SIGTERM. The rest expired while their owner ran: it
	// could neither complete, release nor renew them (a database outage,
	// terminated connections), and wrote nothing for them.
	Takeovers, TakeoversOfKilled, KillsBetweenPhases, TakeoversOfStopped int
	// LeasesLeft is the lease table's rows at the end: must be 0 (every
	// lease completed, released or taken over and completed).
	LeasesLeft int
	// Provider is what the fake payment provider saw.
	Provider ProviderReport
}

// GroupReport is one consumer group's view.
type GroupReport struct {
	Name string
	// Deliveries reached the consumer's chain (from the main topic or a
	// retry topic); Applied committed the handler's effect; Duplicates were
	// acknowledged without running the handler; Failed returned an error and
	// were redelivered: the failures the retry-topic middleware could not
	// move to a retry topic (the database or the broker unreachable, the
	// process closing).
	Deliveries, Applied, Duplicates, Failed int64
	// LedgerRows, DistinctEvents and Sum are read from the ledger at the end.
	LedgerRows, DistinctEvents int
	Sum                        int64
	// Lost counts the events the producer committed that the group never
	// applied; Double those it applied more than once. Both are read from
	// the ledger and must be 0.
	Lost, Double int

	// The retry-topic leg.
	//
	// InProcessRetries is the MaxRetries of the group's watermill Retry.
	// FailedEvents and Failures are read from the database at the end: the
	// events the handler failed on transiently as planned, and how many
	// times in all (equal to [Report.RetryEvents] and
	// [Report.RetryFailures] when the run passes).
	InProcessRetries       int
	FailedEvents, Failures int
	// Escalated counts the deliveries moved to a retry topic after a
	// failure the in-process Retry could not fix (the escalations),
	// EscalatedEvents the distinct events among them (the events that went
	// through a retry topic because they failed), MaxAttempt the highest
	// retry-topic attempt reached. As the processes report them: an
	// escalation whose process was killed before its report is missing.
	Escalated, EscalatedEvents, MaxAttempt int64
	// RetryDeliveries reached the outer middleware from a retry topic;
	// AppliedFromRetry of them applied the event. Deferred counts the
	// deliveries KeyOrder sent along the retry path without running them:
	// later events of a key with an event on the retry path, which follow
	// it there.
	RetryDeliveries, AppliedFromRetry, Deferred int64
	// Poisoned counts messages published to the poison topic; any is a
	// violation.
	Poisoned int64
	// Lease mode: Takeovers of the group's leases, and Charged, its events
	// charged at the provider (each exactly once when the run passes).
	Takeovers, Charged int
	// MaxHandlers is the most main-topic messages one consumer process of
	// the group had in its handler chain at once: at most the partitions
	// it held with watermill-kafka's subscriber, up to
	// [ParallelMaxInFlight] with the parallel one ([Config.Parallel]).
	MaxHandlers int64
	// PoisonedEvents counts the share-group leg's distinct events the
	// group's poison queue took; PoisonMinFailures and PoisonMaxFailures
	// are the fewest and most failures one of them had (at most
	// [ShareMaxDeliveries]: one per delivery). 0 on the other legs.
	PoisonedEvents, PoisonMinFailures, PoisonMaxFailures int
	// Hostile is the hostile keys' view ([Config.HostileKeys]); nil
	// without them.
	Hostile *HostileReport
}

// OK reports whether the run found no violation.
func (r *Report) OK() bool { return len(r.Violations) == 0 }

// String renders the report for a terminal.
func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "soak seed=%d events=%d producer=%s consumers=%q elapsed=%s\n", r.Seed, r.Events, r.Producer, r.Consumers, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "kills (consumer processes SIGKILLed)=%d disruptions (database refused connections for %s)=%d\n", r.Kills, r.Outage, r.Disruptions)
	b.WriteString("faults injected:\n")
	kinds := maps.Clone(r.Faults)
	maps.Copy(kinds, r.Skipped)
	for _, k := range slices.Sorted(maps.Keys(kinds)) {
		fmt.Fprintf(&b, "  %-22s %d", k, r.Faults[k])
		if s := r.Skipped[k]; s > 0 {
			fmt.Fprintf(&b, " (%d skipped)", s)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "  %-22s %d\n", "backends terminated", r.TerminatedBackends)
	fmt.Fprintf(&b, "  %-22s %d\n", "dlq replayed", r.DLQReplayed)
	fmt.Fprintf(&b, "  %-22s %d\n", "published twice", r.DoublePublished)
	fmt.Fprintf(&b, "  %-22s %d events, %d failures in each group\n", "planned to fail", r.RetryEvents, r.RetryFailures)
	if r.PoisonEvents > 0 {
		fmt.Fprintf(&b, "  %-22s %d events, in each group (share group: at delivery %d)\n", "planned poison", r.PoisonEvents, ShareMaxDeliveries)
	}
	fmt.Fprintf(&b, "consumer log lines with \"i/o timeout\": %d\n", r.IOTimeouts)
	fmt.Fprintf(&b, "consumers stopped with SIGTERM: %d, the longest exit %s\n", r.Stops, r.MaxStop.Truncate(time.Millisecond))
	if r.ForwarderExits > 0 {
		fmt.Fprintf(&b, "forwarders stopped on an error and started again: %d\n", r.ForwarderExits)
	}
	if r.OutboxRows > 0 {
		fmt.Fprintf(&b, "outbox rows written and forwarded: %d\n", r.OutboxRows)
	}
	if r.Failover != nil {
		fmt.Fprintf(&b, "failover: %s\n", r.Failover)
	}
	if r.Rebalance != "" {
		fmt.Fprintf(&b, "rebalance protocol: %s\n", r.Rebalance)
	}
	for _, g := range r.Groups {
		fmt.Fprintf(&b, "group %s: lost=%d double=%d | deliveries=%d applied=%d duplicates absorbed=%d failed+redelivered=%d ledger rows=%d distinct=%d sum=%d | main-topic handlers at once in a process: up to %d\n",
			g.Name, g.Lost, g.Double, g.Deliveries, g.Applied, g.Duplicates, g.Failed, g.LedgerRows, g.DistinctEvents, g.Sum, g.MaxHandlers)
		perEvent := 0.0
		if g.AppliedFromRetry > 0 {
			perEvent = float64(g.RetryDeliveries) / float64(g.AppliedFromRetry)
		}
		if g.PoisonMaxFailures > 0 {
			fmt.Fprintf(&b, "  share group (no retry topics: the broker redelivers): failed as planned: %d events (poison events included), %d times\n", g.FailedEvents, g.Failures)
		} else {
			fmt.Fprintf(&b, "  retry topics (in-process retries %d): failed as planned: %d events, %d times | escalated to a retry topic: %d times, %d events, attempts up to %d | deferred behind their key: %d | retry-topic deliveries=%d applied from a retry topic=%d (%.2f deliveries per event on the retry path) | poisoned=%d\n",
				g.InProcessRetries, g.FailedEvents, g.Failures, g.Escalated, g.EscalatedEvents, g.MaxAttempt, g.Deferred, g.RetryDeliveries, g.AppliedFromRetry, perEvent, g.Poisoned)
		}
		if g.PoisonMaxFailures > 0 {
			fmt.Fprintf(&b, "  share group: poisoned events %d (of %d planned), %d times; failures of a poisoned event %d to %d (MaxDeliveries %d)\n",
				g.PoisonedEvents, r.PoisonEvents, g.Poisoned, g.PoisonMinFailures, g.PoisonMaxFailures, ShareMaxDeliveries)
		}
		if x := g.Hostile; x != nil {
			fmt.Fprintf(&b, "  hostile keys: hot %s: %d of %d events in the ledger, %d of them overlapped by other keys' applications | failing %s: %d of %d events in the ledger, its first one failed %d times over %s (nacked), %d other events applied before it (released at %d) | spilled records at once in a process: up to %d\n",
				x.HotKey, x.HotRows, x.HotEvents, x.HotOverlapped, x.FailingKey, x.FailingRows, x.FailingEvents, x.BlockedFailures, x.BlockedFor.Round(time.Millisecond), x.AppliedBeforeHead, x.ReleaseAt, x.MaxSpilled)
		}
	}
	if l := r.Lease; l != nil {
		fmt.Fprintf(&b, "lease mode (lease %s): takeovers=%d: of leases live when their owner was SIGKILLed=%d (left by %d kills between the phases), SIGTERMed=%d, expired under a running owner=%d | leases left=%d\n",
			l.Duration, l.Takeovers, l.TakeoversOfKilled, l.KillsBetweenPhases, l.TakeoversOfStopped, l.Takeovers-l.TakeoversOfKilled-l.TakeoversOfStopped, l.LeasesLeft)
		fmt.Fprintf(&b, "  provider: requests=%d charges executed=%d replayed (same key again)=%d refused in progress (409)=%d", l.Provider.Requests, l.Provider.Charges, l.Provider.Replayed, l.Provider.Conflicts)
		for _, g := range r.Groups {
			fmt.Fprintf(&b, " | %s: charged %d events, takeovers %d", g.Name, g.Charged, g.Takeovers)
		}
		b.WriteString("\n")
	}
	if r.Database != "" {
		fmt.Fprintf(&b, "database kept: %s\n", r.Database)
	}
	if r.OK() {
		b.WriteString("PASS: every event applied exactly once per group\n")
	} else {
		fmt.Fprintf(&b, "FAIL (seed %d): %d violation(s)\n", r.Seed, len(r.Violations))
		for _, v := range r.Violations {
			fmt.Fprintf(&b, "  - %s\n", v)
		}
	}
	return b.String()
}
