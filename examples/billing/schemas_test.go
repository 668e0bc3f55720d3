package main

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// updateSchemas rewrites docs/schemas from the contracts: make schemas.
var updateSchemas = flag.Bool("update-schemas", false, "rewrite docs/schemas from the example's contracts")

// TestSchemasAreCurrent keeps docs/schemas, the JSON Schema documents other
// languages validate the example's events with, equal to what the Go
// contracts generate: a change to an event's struct or validate tags that is
// not followed by make schemas fails here (and so in CI).
func TestSchemasAreCurrent(t *testing.T) {
	t.Parallel()
	schemas := map[string]func() ([]byte, error){
		EventOrderConfirmed: orderConfirmedV1.JSONSchema,
		EventBillingCharged: billingChargedV1.JSONSchema,
	}
	dir := filepath.Join("..", "..", "docs", "schemas")
	for typ, gen := range schemas {
		want, err := gen()
		require.NoError(t, err, typ)
		path := filepath.Join(dir, typ+".json")
		if *updateSchemas {
			require.NoError(t, os.WriteFile(path, want, 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		require.NoError(t, err, "%s: run make schemas", path)
		require.Equal(t, string(want), string(got), "%s is stale: run make schemas", path)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		if filepath.Ext(e.Name()) == ".json" {
			_, ok := schemas[e.Name()[:len(e.Name())-len(".json")]]
			require.True(t, ok, "docs/schemas/%s has no contract in the example: remove it", e.Name())
		}
	}
}
