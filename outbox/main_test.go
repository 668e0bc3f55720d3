package outbox_test

import (
	"testing"

	"go.uber.org/goleak"
)

// The forwarder, its producer and the routers start goroutines; every one
// of them must be gone when the tests end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry starts one global ticker, never stopped.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
