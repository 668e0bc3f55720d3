package soak_test

import (
	"context"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/tests/soak"
)

// TestSoakFailover is a short soak whose only fault is the failover
// (soak.FaultCounts.Failover): the run's database on a throwaway primary
// with an asynchronous standby behind a movable address, replication cut,
// the consumers going on on the primary alone with their offsets
// committed, the primary stopped immediately, the standby promoted and
// the address moved; then every event applied exactly once per group, in
// each aggregate's order, with the default failing events through the
// retry topics. On watermill-kafka's subscriber the harness
// rewinds the groups to PostgreSQL's position (the operator's `idemctl
// groups progress --rewind`); the parallel and franz (KIP-848)
// subscribers start from it themselves (Progress). IDEM_FAILOVER_PROGRESS=off keeps the position in
// Kafka only (soak.Config.SkipProgress): the test then fails, the events
// applied after the cut lost.
//
// It uses none of the main server's connections: the run's database is on
// the throwaway cluster.
func TestSoakFailover(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	if testing.Short() {
		t.Skip("soak: skipped in -short mode")
	}
	if _, err := os.Stat(filepath.Join(pgcluster.BinDir, "pg_ctl")); err != nil {
		t.Skip("needs the PostgreSQL 15 server programs in " + pgcluster.BinDir)
	}
	for _, mode := range []struct {
		name     string
		parallel bool
		engine   string
	}{
		{"watermill-kafka subscriber", false, ""},
		{"parallel subscriber", true, ""},
		{"franz subscriber", false, soak.EngineFranz},
	} {
		t.Run(mode.name, func(t *testing.T) {
			cfg := soak.Config{
				Seed:       20261205,
				Events:     1500,
				Aggregates: 32,
				Faults:     soak.FaultCounts{Failover: 1},
				Parallel:   mode.parallel,
				Engine:     mode.engine,
				// The default failing events go through the retry topics
				// across the failover (KeyOrder on): their partitions have
				// a position from their assignment on, and copies whose
				// parks the promotion undid are acked without running.
				SkipProgress: os.Getenv("IDEM_FAILOVER_PROGRESS") == "off",
				Timeout:      10 * time.Minute, // a bound, not a target
				DatabaseURL:  pgtest.URL(),
				Brokers:      kafkatest.External(),
			}
			// SIGTERM ends the run with its report, and removes its clusters.
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
			defer stop()
			rep := runSoak(ctx, t, cfg)
			require.NotNil(t, rep.Failover, "the run had no failover")
			require.Equal(t, 1, rep.Faults["failover (async standby promoted)"], "failover done")
			require.Positive(t, rep.Failover.LedgerLost, "the promotion undid no application: the cut came too late to lose anything")
			for _, g := range rep.Groups {
				require.Equal(t, cfg.Events, g.LedgerRows, g.Name)
			}
			require.Empty(t, rep.Failover.Unpositioned, "partitions with a Kafka offset but no position on the promoted standby")
			require.True(t, rep.OK(), "soak violations (seed %d):\n%s", rep.Seed, rep.String())
		})
	}
}
