package soak_test

import (
	"testing"

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
