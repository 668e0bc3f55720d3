package otelchain_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if routers, subscribers, forwarders, pools or the
// in-process broker leave goroutines behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
