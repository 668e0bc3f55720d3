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
		// Watermill's universal Pub/Sub tests (TestPubSub) read from a
		// subscriber multiplier of their own (pubsub/tests'
		// createMultipliedSubscriber) and stop reading once they have the
		// messages they expect; a copy arriving after that leaves the
		// multiplier's forwarding goroutine blocked on its output channel,
		// and its closer waiting for it. Seen once in make test (t4,
		// 2026-12-01); not this module's goroutines.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
	)
}
