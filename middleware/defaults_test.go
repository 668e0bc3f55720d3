package middleware

import (
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Each config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	var cfg Config
	cfg.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: cfg, Section: "`idem.Config`",
		Names: map[string]any{"publisher.EventIDFromMessage": publisher.EventIDFromMessage, "time.Now": time.Now,
			"deduplicator.DefaultStaleMargin": deduplicator.DefaultStaleMargin},
		Described: map[string]string{
			"Table":     "a deduplicator.TableConfig, checked in its package",
			"TxOptions": "the zero pgx.TxOptions: the server's default",
		}})
	var lease LeaseConfig
	lease.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: lease, Section: "`idem.LeaseConfig`",
		Described: map[string]string{
			"RenewInterval": "a third of Duration",
			"Owner":         "the host's name and the process id",
		}})
	var group GroupCommitConfig
	group.setDefaults()
	configdoc.Check(t, configdoc.Spec{Value: group, Section: "`idem.GroupCommitConfig`"})
}
