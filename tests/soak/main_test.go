package soak_test

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/watermill-idempotency/tests/soak"
)

// Every router, consumer, producer, forwarder and pool a soak starts is
// stopped before Run returns.
//
// The soak re-executes this test binary as its consumer processes.
func TestMain(m *testing.M) {
	soak.RunConsumerIfChild()
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry keeps a process-wide ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// runSoak runs cfg (its log on stderr with -v), logs the report and
// requires that no group lost or doubled an event; the caller checks the
// rest of the report.
func runSoak(ctx context.Context, t *testing.T, cfg soak.Config) *soak.Report {
	t.Helper()
	if testing.Verbose() {
		cfg.Log = os.Stderr
	}
	rep, err := soak.Run(ctx, cfg)
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	for _, g := range rep.Groups {
		require.Zero(t, g.Lost, "%s: events lost", g.Name)
		require.Zero(t, g.Double, "%s: events applied twice", g.Name)
	}
	return rep
}
