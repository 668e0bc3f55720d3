package parallel

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// The Subscriber's defaults, applied to a zero config, are what its fields'
// doc comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var sub SubscriberConfig
	sub.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: sub, Section: "`parallel.SubscriberConfig`",
		Names: map[string]any{"idemkafka.Marshaler{}": idemkafka.Marshaler{}, "OrderKey": OrderKey},
		Described: map[string]string{
			"Client": "Brokers required",
		}})
}
