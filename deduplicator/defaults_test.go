package deduplicator

import (
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// Each config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	names := map[string]any{"LayoutPlain": LayoutPlain, "DefaultStaleMargin": DefaultStaleMargin, "time.Now": time.Now}
	var table TableConfig
	table.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: table, Section: "`deduplicator.TableConfig`", RowPrefix: "TableConfig.", Names: names})
	var cfg Config
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`deduplicator.TableConfig`", RowPrefix: "Config.", Names: names,
		Skip: map[string]string{"TableConfig": "checked above"}})
	var cleaner CleanerConfig
	cleaner.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cleaner, Section: "`deduplicator.CleanerConfig`", Names: names,
		Skip: map[string]string{"TableConfig": "checked above"}})
}
