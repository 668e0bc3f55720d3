package main

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if the demo's routers, subscribers, producers,
// forwarder, HTTP server and clients or the in-process broker leave
// goroutines behind.
func TestMain(m *testing.M) {
	runChildIfSet() // TestDemo's billing processes re-execute the test binary
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
