package soak_test

import (
	"context"
	"os"
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
// database refuses connections for a while; every fault kind at least once;
// 5 % of the events fail transiently 1 to 3 times and go through the retry
// topics; then "every event applied exactly once per group".
func TestSoakShort(t *testing.T) {
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	t.Parallel()
	for _, mode := range []struct {
		name        string
		groupCommit bool
	}{{"one transaction per message", false}, {"group commit", true}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			cfg := soak.Config{
				Seed:        20261130,
				Events:      1500,
				Aggregates:  32,
				Faults:      soak.ShortFaults,
				GroupCommit: mode.groupCommit,
				Timeout:     150 * time.Second,
				DatabaseURL: pgtest.URL(),
				Brokers:     kafkatest.External(),
			}
			if testing.Verbose() {
				cfg.Log = os.Stderr
			}
			rep, err := soak.Run(context.Background(), cfg)
			require.NoError(t, err)
			t.Log("\n" + rep.String())
			require.True(t, rep.OK(), "soak violations (seed %d):\n%s", rep.Seed, rep.String())
			for _, g := range rep.Groups {
				require.Zero(t, g.Lost, "%s: events lost", g.Name)
				require.Zero(t, g.Double, "%s: events applied twice", g.Name)
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
			require.GreaterOrEqual(t, rep.Kills, 2, "consumer processes killed with SIGKILL")
			require.Equal(t, rep.Faults["sigkill-mid-handler"]+rep.Faults["sigkill-after-commit"]+rep.Faults["sigkill-random"], rep.Kills, "every kill is in the report")
			require.Positive(t, rep.Disruptions)
			for _, kind := range []string{"sigkill-mid-handler", "sigkill-after-commit", "sigkill-random", "pg-disruption", "restart (rejoin)", "join (rebalance)", "pg-terminate-consumer", "restart-forwarder", "offset-reset"} {
				require.Positive(t, rep.Faults[kind], "fault %q was never injected", kind)
			}
			require.Positive(t, rep.Faults["pg-terminate-forwarder"]+rep.Faults["pg-terminate-producer"], "no producer-side backend terminated")
			require.Positive(t, rep.DLQReplayed)
			require.Positive(t, rep.DoublePublished)
			require.GreaterOrEqual(t, rep.OutboxRows, cfg.Events+rep.DoublePublished)
		})
	}
}

// The checker can fail: a handler that writes outside the middleware's
// transaction applies an event twice when its process is killed
// mid-handler, or when it fails after the write and the event is retried
// (in process and from a retry topic), and the soak must report it.
func TestSoakDetectsNonTransactionalHandler(t *testing.T) {
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	t.Parallel()
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
				Seed:                  7,
				Events:                300,
				Aggregates:            16,
				Faults:                c.faults,
				DLQPercent:            -1,
				DoublePercent:         -1,
				RetryPercent:          c.retryPercent,
				UnsafeLedgerOutsideTx: true,
				Timeout:               60 * time.Second,
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
