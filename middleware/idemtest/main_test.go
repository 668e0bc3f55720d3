package idemtest_test

import (
	"testing"

	"go.uber.org/goleak"
)

// RunWithRedelivery's deliveries all finish before it returns, and the kit's
// broker stops with its test.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
