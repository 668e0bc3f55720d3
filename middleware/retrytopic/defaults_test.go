package retrytopic

import (
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Each config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	cfg := Config{KeyOrder: &KeyOrder{}}
	cfg.setDefaults()
	names := map[string]any{"time.Now": time.Now, "idem.IsPermanent": idem.IsPermanent, "publisher.EventIDFromMessage": publisher.EventIDFromMessage}
	top := cfg
	top.KeyOrder = nil // the zero Config's
	configdoc.Check(t, configdoc.Spec{Value: top, Section: "`retrytopic.Config`", Names: names,
		Described: map[string]string{"Backoff": "the zero Backoff, checked below"}})
	configdoc.Check(t, configdoc.Spec{Value: cfg.Backoff, Section: "`retrytopic.Backoff`"})
	configdoc.Check(t, configdoc.Spec{Value: *cfg.KeyOrder, Section: "`retrytopic.KeyOrder`", Names: names,
		Described: map[string]string{
			"Table":   "public.retry_parked_key, a ParkedKeysTable (its fields state their defaults)",
			"KeyFunc": "the partition_key metadata, else the Kafka record key",
		}})
}
