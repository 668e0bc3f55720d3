package soak_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/tests/soak"
)

// TestSoakShort is a short, seeded chaos soak: consumers are child processes
// on the library's default Sarama settings, killed with SIGKILL; the
// database refuses connections for a while; every fault kind scheduled
// (those whose target depends on timing may be skipped, and are reported);
// 5 % of the events fail transiently 1 to 3 times and go through the retry
// topics; then "every event applied exactly once per group" and each
// aggregate's events in order. Four runs: watermill-kafka's subscriber in
// both commit modes, and idemkafka's parallel subscriber in group commit
// mode, with the hostile keys (a hot key, a failing key, PartitionWindow
// 16: see soak.Config.HostileKeys), and in lease mode (the handler calls a
// fake provider between the phases; processes are killed after the call and
// during it).
//
// The soak tests run one at a time, not in parallel: a run holds up to ~40
// PostgreSQL connections (its producer, forwarder, five or six consumer
// processes), two side by side would take the whole suite past its
// connection budget (docs/testing.md, "Connection budget").
func TestSoakShort(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	for _, mode := range []struct {
		name        string
		groupCommit bool
		parallel    bool
		lease       bool
		hostile     bool
	}{
		{"one transaction per message", false, false, false, false},
		{"group commit", true, false, false, false},
		// idemkafka's parallel subscriber, with the per-key order check
		// and the hostile keys; in group commit mode its processes' pools
		// stay at 4 connections (the suite's budget), one transaction per
		// message would need one per message in flight.
		{"parallel subscriber, group commit, hostile keys", true, true, false, true},
		// Lease mode: 2 x 1 + 1 connections for the middleware's phases,
		// whatever the messages in flight.
		{"parallel subscriber, lease mode", false, true, true, false},
	} {
		t.Run(mode.name, func(t *testing.T) {
			cfg := soak.Config{
				Seed:        20261130,
				Events:      1500,
				Aggregates:  32,
				Faults:      soak.ShortFaults,
				GroupCommit: mode.groupCommit,
				Parallel:    mode.parallel,
				Lease:       mode.lease,
				HostileKeys: mode.hostile,
				Timeout:     10 * time.Minute, // a bound, not a target: under -race a run takes 1 to 3 min on an idle 2-core machine, up to 6 on a crowded one
				DatabaseURL: pgtest.URL(),
				Brokers:     kafkatest.External(),
			}
			if mode.lease {
				cfg.Faults = soak.ShortLeaseFaults
			}
			rep := runSoak(context.Background(), t, cfg)
			require.True(t, rep.OK(), "soak violations (seed %d):\n%s", rep.Seed, rep.String())
			for _, g := range rep.Groups {
				require.Equal(t, cfg.Events, g.LedgerRows, g.Name)
				require.Positive(t, g.Duplicates, "%s: the faults produced no duplicate to absorb", g.Name)
				// The retry-topic leg: every planned failure happened, events
				// went through a retry topic and were applied from there,
				// none was poisoned.
				require.Equal(t, rep.RetryEvents, g.FailedEvents, "%s: events that failed as planned", g.Name)
				require.Equal(t, rep.RetryFailures, g.Failures, "%s: planned failures", g.Name)
				require.Positive(t, g.EscalatedEvents, "%s: no event went through a retry topic", g.Name)
				require.Positive(t, g.AppliedFromRetry, "%s: no event applied from a retry topic", g.Name)
				require.Zero(t, g.Poisoned, "%s: poisoned", g.Name)
			}
			require.Positive(t, rep.RetryEvents, "no event planned to fail")
			requireFaults(t, cfg.Faults, rep)
			// The leave and the offset resets end consumer processes with
			// SIGTERM, mid-stream (keys parked on the retry path, groups in
			// flight): each exited within soak.MaxStopWait, or the run has
			// a violation.
			require.Positive(t, rep.Stops, "no consumer was stopped with SIGTERM")
			require.Less(t, rep.MaxStop, soak.MaxStopWait)
			require.Positive(t, rep.DLQReplayed)
			require.Positive(t, rep.DoublePublished)
			require.GreaterOrEqual(t, rep.OutboxRows, cfg.Events+rep.DoublePublished)
			if mode.lease {
				requireLease(t, cfg, rep)
			}
			if mode.parallel {
				require.True(t, strings.HasPrefix(rep.Rebalance, "cooperative-sticky:"), "rebalance protocol: %s", rep.Rebalance)
			}
			if mode.hostile {
				requireHostile(t, rep)
			}
		})
	}
}

// requireHostile checks the hostile keys of a run (verify already turned
// each of these into a violation; here they are named): both keys' events
// applied once each, the failing key's first event failed and was applied
// after the other keys had flowed around it, the hot key's handlers were
// overlapped by other keys' applications, and the main topic's windows
// spilled.
func requireHostile(t *testing.T, rep *soak.Report) {
	t.Helper()
	for _, g := range rep.Groups {
		x := g.Hostile
		require.NotNil(t, x, g.Name)
		require.Positive(t, x.HotEvents, "%s: hot key events", g.Name)
		require.Equal(t, x.HotEvents, x.HotRows, "%s: hot key %s in the ledger", g.Name, x.HotKey)
		require.Positive(t, x.FailingEvents, "%s: failing key events", g.Name)
		require.Equal(t, x.FailingEvents, x.FailingRows, "%s: failing key %s in the ledger", g.Name, x.FailingKey)
		require.Positive(t, x.BlockedFailures, "%s: the failing key's first event failed", g.Name)
		require.GreaterOrEqual(t, x.AppliedBeforeHead, x.ReleaseAt, "%s: other events applied before the failing key's first", g.Name)
		require.Positive(t, x.HotOverlapped, "%s: hot key handlers overlapped by other keys' applications", g.Name)
		require.Positive(t, x.MaxSpilled, "%s: spilled records", g.Name)
	}
}

// requireLease checks a lease-mode run: every event charged once per group
// at the provider, no lease left, and each process killed after its call
// or during it left a lease behind that another delivery took over once it
// expired (verify already turned a double charge or a lease left into a
// violation).
func requireLease(t *testing.T, cfg soak.Config, rep *soak.Report) {
	t.Helper()
	l := rep.Lease
	require.NotNil(t, l)
	require.Zero(t, l.LeasesLeft, "leases left")
	require.Equal(t, 2*cfg.Events, l.Provider.Charges, "charges executed at the provider")
	for _, g := range rep.Groups {
		require.Equal(t, cfg.Events, g.Charged, "%s: events charged", g.Name)
	}
	between := rep.Faults["sigkill-after-call"] + rep.Faults["sigkill-mid-call"]
	require.GreaterOrEqual(t, l.KillsBetweenPhases, between, "kills between the phases whose leases were taken over")
	require.GreaterOrEqual(t, l.TakeoversOfKilled, between, "killed owners' leases taken over")
	if between > 0 {
		require.Positive(t, l.Provider.Replayed, "a call repeated after a takeover is answered from its key")
	}
}

// requireFaults checks the faults of a run of fc: those the schedule
// guarantees (each waits for its target, see faults.go) were all injected,
// and every other one was injected or reported skipped. Whether a
// consumer executes an armed kill, or a pg-terminate finds a connection
// open, depends on timing: a skip is logged, not failed.
func requireFaults(t *testing.T, fc soak.FaultCounts, rep *soak.Report) {
	t.Helper()
	// At least one kill and rebalance in every run: a consuming process
	// SIGKILLed, its partitions reassigned, its replacement joining.
	require.Positive(t, fc.Kill)
	require.Equal(t, fc.Kill, rep.Faults["sigkill-random"], "sigkill-random")
	require.GreaterOrEqual(t, rep.Faults["restart (rejoin)"], rep.Faults["sigkill-random"], "a killed process's replacement started")
	require.Equal(t, fc.Join, rep.Faults["join (rebalance)"], "join (rebalance)")
	require.Equal(t, fc.Join, rep.Faults["leave (rebalance)"], "leave (rebalance)")
	require.Equal(t, fc.DisruptDB, rep.Faults["pg-disruption"], "pg-disruption")
	require.Equal(t, fc.DisruptDB, rep.Disruptions)
	require.Equal(t, fc.RestartForwarder, rep.Faults["restart-forwarder"], "restart-forwarder")
	require.Equal(t, 2*fc.OffsetResetPerGrp, rep.Faults["offset-reset"], "offset-reset")
	// The outbox producer's forwarder met a row over the producer's limit
	// (verify checks it is the only dead row); the in-process broker
	// moved every leader mid-run.
	require.Equal(t, fc.OversizeRow, rep.Faults["oversize-row"], "oversize-row")
	if kafkatest.External() == nil {
		require.Equal(t, fc.LeaderElection, rep.Faults["leader-election"], "leader-election")
	}
	require.Equal(t, rep.Faults["sigkill-mid-handler"]+rep.Faults["sigkill-after-call"]+rep.Faults["sigkill-mid-call"]+rep.Faults["sigkill-after-commit"]+rep.Faults["sigkill-random"]+rep.Faults["sigkill-while-joining (crash loop)"], rep.Kills, "every kill is in the report")

	injected := func(kind string) int {
		if kind == "pg-terminate-producer" {
			return rep.Faults[kind] + rep.Faults["pg-terminate-forwarder"]
		}
		return rep.Faults[kind]
	}
	for kind, n := range rep.Scheduled {
		require.Equal(t, n, injected(kind)+rep.Skipped[kind], "fault %q: scheduled = injected + skipped", kind)
		if rep.Skipped[kind] > 0 {
			t.Logf("fault %q: %d of %d skipped (no target, or not executed before the end)", kind, rep.Skipped[kind], n)
		}
	}
}

// The checker can fail: a handler that writes outside the middleware's
// transaction applies an event twice when its process is killed
// mid-handler, or when it fails after the write and the event is retried
// (in process and from a retry topic), and the soak must report it.
func TestSoakDetectsNonTransactionalHandler(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	for _, c := range []struct {
		name         string
		faults       soak.FaultCounts
		retryPercent int
	}{
		// Kills only: the planned failures would double events too.
		{"killed mid-handler", soak.FaultCounts{KillMidHandler: 3}, -1},
		// Planned failures only (a producer-side fault: no consumer is
		// killed): each failed attempt leaves its ledger row behind.
		{"failed transiently", soak.FaultCounts{TerminateProducer: 1}, 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			rep, err := soak.Run(context.Background(), soak.Config{
				Seed:       7,
				Events:     300,
				Aggregates: 16,
				// Small: the unsafe handler's pools hold a connection per
				// partition of each topic a process consumes (see
				// [soak.Config.UnsafeLedgerOutsideTx]), 3 processes of
				// 2 x 3 + 2 here.
				Partitions:            2,
				Instances:             2,
				SecondInstances:       1,
				Producers:             2,
				Faults:                c.faults,
				DLQPercent:            -1,
				DoublePercent:         -1,
				RetryPercent:          c.retryPercent,
				UnsafeLedgerOutsideTx: true,
				Timeout:               2 * time.Minute,
				DatabaseURL:           pgtest.URL(),
				Brokers:               kafkatest.External(),
			})
			require.NoError(t, err)
			require.False(t, rep.OK(), "the soak missed a double application:\n%s", rep.String())
			require.Contains(t, strings.Join(rep.Violations, "\n"), "applied more than once")
			double := 0
			for _, g := range rep.Groups {
				double += g.Double
				if c.retryPercent > 0 {
					require.Equal(t, rep.RetryEvents, g.Double, "%s: each event that failed was applied more than once", g.Name)
					require.Positive(t, g.EscalatedEvents, "%s: no event went through a retry topic", g.Name)
				}
			}
			require.Positive(t, double, "the report counts the events applied twice")
			if c.retryPercent < 0 {
				require.Positive(t, rep.Faults["sigkill-mid-handler"])
			}
		})
	}
}

// The checker can fail in lease mode too: a handler that sends a new
// Idempotency-Key with each call is charged again by the provider whenever
// its event is called again (here after each planned failure, which comes
// after the call), and the soak must report it.
func TestSoakDetectsUnstableIdempotencyKey(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	rep, err := soak.Run(context.Background(), soak.Config{
		Seed:            7,
		Events:          300,
		Aggregates:      16,
		Partitions:      2,
		Instances:       2,
		SecondInstances: 1,
		Producers:       2,
		Faults:          soak.FaultCounts{TerminateProducer: 1}, // no consumer fault: the planned failures repeat the calls
		// DLQ replays on (the default): they are published without a
		// transaction, after the producer is done, so they end the main
		// topic's partitions. Without them (DLQPercent -1) the run never
		// converged here: the main topic's lag stayed at one per partition
		// (2), probably the forwarder's last transaction marker, which no
		// consumer commits past.
		RetryPercent:           20,
		Parallel:               true,
		Lease:                  true,
		UnstableIdempotencyKey: true,
		Timeout:                3 * time.Minute,
		DatabaseURL:            pgtest.URL(),
		Brokers:                kafkatest.External(),
	})
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.False(t, rep.OK(), "the soak missed a double charge:\n%s", rep.String())
	all := strings.Join(rep.Violations, "\n")
	require.NotContains(t, all, "did not converge")
	// Each event planned to fail was called again after its failure, with
	// a new key: charged again. The others were called once.
	require.Contains(t, all, fmt.Sprintf(": %d events charged more than once at the provider", rep.RetryEvents))
	require.Contains(t, all, fmt.Sprintf(": %d events called with more than one Idempotency-Key", rep.RetryEvents))
	for _, g := range rep.Groups {
		// The ledger is right: the middleware applied each event once.
		require.Zero(t, g.Lost, g.Name)
		require.Zero(t, g.Double, g.Name)
	}
	require.Greater(t, rep.Lease.Provider.Charges, 2*300, "charges beyond one per event and group")
}
