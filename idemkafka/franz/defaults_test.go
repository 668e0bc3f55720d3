package franz

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// The Subscriber's defaults, applied to a zero config, are what its fields'
// doc comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var sub SubscriberConfig
	sub.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: sub, Section: "`franz.SubscriberConfig`",
		Names: map[string]any{"parallel.OrderKey": parallel.OrderKey},
		Described: map[string]string{
			"Brokers":         "required",
			"ClientOpts":      "none",
			"ShareGroup":      "a consumer group",
			"IsPermanentFunc": "nil (only idem.Permanent's mark)",
		}})
}
