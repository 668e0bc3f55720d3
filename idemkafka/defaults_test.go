package idemkafka

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/testkit/configdoc"
)

// Each config's defaults, applied to a zero value, are what its fields' doc
// comments and docs/configuration.md state.
func TestDefaultsMatchTheirDocs(t *testing.T) {
	t.Parallel()
	configdoc.Check(t, configdoc.Spec{Value: ClientConfig{}, Section: "`idemkafka.ClientConfig`",
		Described: map[string]string{
			"Sarama":        "a fresh sarama.NewConfig(), made by each helper",
			"Logger":        "sarama.Logger for the corrections, none for the rest",
			"RevokeTimeout": "10 s, or a quarter of the base's rebalance timeout below 40 s",
		}})
}
