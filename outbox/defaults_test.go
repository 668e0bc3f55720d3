package outbox

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// Each config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var cfg Config
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`outbox.Config`", Names: map[string]any{"BYTEA": "BYTEA"}})
	var fwd ForwarderConfig
	fwd.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: fwd, Section: "`outbox.ForwarderConfig`",
		Names: map[string]any{"DefaultForwarderName": DefaultForwarderName, "idemkafka.Marshaler": idemkafka.Marshaler{}, "Marshaler{}": idemkafka.Marshaler{}},
		Described: map[string]string{
			"Topics":          "the Outbox's Config.Topics",
			"MaxMessageBytes": "the Outbox's Config.MaxMessageBytes",
		}})
}
