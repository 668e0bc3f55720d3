package conformance_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Subscribers, clients and the in-process broker must all be gone when
// the tests end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
