package soak_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/tests/soak"
)

// TestSoakFranzShort runs the soak's legs on the franz-go engine
// (idemkafka/franz) in their short form, as `make soak/franz -short`
// would: KIP-848 consumer groups on the main topic and the retry topics,
// with kills and a rolling restart (each instance of a group stopped with
// SIGTERM and replaced, one after the other, under load), every event
// applied once per group and in its aggregate's order; then a KIP-932
// share group with kills: no order, every event applied once but the
// poison events, which the poison queue takes once their delivery count
// reaches soak.ShareMaxDeliveries. Skipped with -short, as TestSoakShort.
// On an idle 2-core machine a leg takes 30 to 60 s under -race.
func TestSoakFranzShort(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	for _, leg := range []struct {
		name   string
		share  bool
		faults soak.FaultCounts
	}{
		{"KIP-848, kills and a rolling restart", false, soak.ShortFranzFaults},
		{"share group, kills", true, soak.ShortShareFaults},
	} {
		t.Run(leg.name, func(t *testing.T) {
			cfg := soak.Config{
				Seed:       20261205,
				Events:     1500,
				Aggregates: 32,
				Engine:     soak.EngineFranz,
				Share:      leg.share,
				// Group commit: a process's pool stays at 4 connections,
				// within the suite's budget (docs/testing.md, "Connection
				// budget"); one transaction per message would need one per
				// message in flight, 8 per process (make soak/franz runs
				// that).
				GroupCommit: true,
				Faults:      leg.faults,
				Timeout:     10 * time.Minute, // a bound, not a target
				DatabaseURL: pgtest.URL(),
				Brokers:     kafkatest.External(),
			}
			rep := runSoak(context.Background(), t, cfg)
			require.True(t, rep.OK(), "soak violations (seed %d):\n%s", rep.Seed, rep.String())
			requireFaults(t, cfg.Faults, rep)
			require.Positive(t, rep.RetryEvents, "no event planned to fail")
			for _, g := range rep.Groups {
				require.Equal(t, cfg.Events-rep.PoisonEvents, g.LedgerRows, g.Name)
				require.Positive(t, g.Duplicates, "%s: the faults produced no duplicate to absorb", g.Name)
			}
			if leg.share {
				requireShare(t, rep)
				return
			}
			require.Equal(t, cfg.Faults.RollingRestart, rep.Faults["rolling-restart"], "rolling-restart")
			require.True(t, strings.HasPrefix(rep.Rebalance, "ConsumerGroupHeartbeat (KIP-848):"), "group protocol: %s", rep.Rebalance)
			for _, g := range rep.Groups {
				require.Equal(t, rep.RetryEvents, g.FailedEvents, "%s: events that failed as planned", g.Name)
				require.Equal(t, rep.RetryFailures, g.Failures, "%s: planned failures", g.Name)
				require.Positive(t, g.EscalatedEvents, "%s: no event went through a retry topic", g.Name)
				require.Positive(t, g.AppliedFromRetry, "%s: no event applied from a retry topic", g.Name)
				require.Zero(t, g.Poisoned, "%s: poisoned", g.Name)
			}
		})
	}
}

// requireShare checks the share-group leg (verify already turned each of
// these into a violation; here they are named): the group protocol, and
// the poison queue took every poison event, driven by the delivery count.
func requireShare(t *testing.T, rep *soak.Report) {
	t.Helper()
	require.True(t, strings.HasPrefix(rep.Rebalance, "ShareGroupHeartbeat (KIP-932):"), "group protocol: %s", rep.Rebalance)
	require.Positive(t, rep.PoisonEvents, "no poison event planned")
	for _, g := range rep.Groups {
		require.Equal(t, rep.PoisonEvents, g.PoisonedEvents, "%s: poison events poisoned", g.Name)
		require.GreaterOrEqual(t, g.Poisoned, int64(rep.PoisonEvents), "%s: poisonings", g.Name)
		require.Equal(t, rep.RetryEvents+rep.PoisonEvents, g.FailedEvents, "%s: events that failed as planned (poison events included)", g.Name)
		require.Positive(t, g.PoisonMinFailures, "%s: a poison event that never failed", g.Name)
		// Most poison events fail on each of their deliveries up to the
		// one that is made permanent (a kill may take one of them).
		require.GreaterOrEqual(t, g.PoisonMaxFailures, soak.ShareMaxDeliveries, "%s: failures of a poison event", g.Name)
	}
}

// The franz-go legs refuse what they do not run: Sarama's parallel
// subscriber or lease mode beside them, a group protocol on Sarama, a
// share group on Sarama, and the faults a share group has no target for.
func TestConfigRefusesFranzMisuse(t *testing.T) {
	ok := soak.Config{DatabaseURL: "postgres://x", Events: 1, Aggregates: 1, Partitions: 1, Instances: 1, SecondInstances: 1, Producers: 1,
		Engine: soak.EngineFranz, GroupProtocol: "consumer"}
	require.NoError(t, ok.Validate())
	for name, change := range map[string]func(*soak.Config){
		"Engine":        func(c *soak.Config) { c.Engine = "kafka-go" },
		"Parallel":      func(c *soak.Config) { c.Parallel = true },
		"Lease":         func(c *soak.Config) { c.Lease = true },
		"GroupProtocol": func(c *soak.Config) { c.GroupProtocol = "eager" },
		"Sarama":        func(c *soak.Config) { c.Engine = soak.EngineSarama },
		"Share":         func(c *soak.Config) { c.Engine, c.GroupProtocol, c.Share = soak.EngineSarama, "", true },
		"OffsetReset":   func(c *soak.Config) { c.Share, c.Faults = true, soak.ShortFaults },
		"ShareFailover": func(c *soak.Config) { c.Share, c.Faults = true, soak.FaultCounts{Failover: 1} },
	} {
		c := ok
		change(&c)
		require.Error(t, c.Validate(), name)
	}
	c := ok
	c.Share, c.Faults = true, soak.ShortShareFaults
	require.NoError(t, c.Validate())
	c = ok
	c.Faults = soak.FaultCounts{Failover: 1}
	require.NoError(t, c.Validate(), "the franz subscriber keeps its position in PostgreSQL: the failover fault runs on it")
}
