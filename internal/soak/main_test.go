package soak_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every router, consumer, producer, forwarder and pool a soak starts is
// stopped before Run returns.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry keeps a process-wide ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
