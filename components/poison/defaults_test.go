package poison

import (
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// The config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var cfg Config
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`poison.Config`",
		Names: map[string]any{"time.Now": time.Now},
		Described: map[string]string{
			"Kafka":  "an idemkafka.ClientConfig: its Brokers are required",
			"Filter": "the zero Filter, which matches every message",
		}})
}

func TestPageDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var cfg PageConfig
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`poison.PageConfig`",
		Described: map[string]string{
			"Kafka":  "an idemkafka.ClientConfig: its Brokers are required",
			"Filter": "the zero Filter, which matches every message",
		}})
}
