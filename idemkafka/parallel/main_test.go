package parallel_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Routers, subscribers and the in-process broker must all be gone when the
// tests end. A test binary started as a consumer child runs it instead.
func TestMain(m *testing.M) {
	runChildIfAsked()
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
