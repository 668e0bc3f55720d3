package heartbeat

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// The config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var cfg Config
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`heartbeat.Config`",
		Described: map[string]string{
			"Instance": "the host name and the process id",
			"Version":  "the main module's version from the build info",
		}})
}
