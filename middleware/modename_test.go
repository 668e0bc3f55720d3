package middleware_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Dedup.Mode names the mode Config.Mode chose, as the heartbeat reports it.
func TestModeNames(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(table)))
	for want, mode := range map[string]idem.Mode{
		"transaction":  nil,
		"group-commit": &idem.GroupCommitConfig{},
		"lease":        &idem.LeaseConfig{},
	} {
		d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "modes-" + want, Table: table, Mode: mode}, nil)
		require.NoError(t, err, want)
		require.Equal(t, want, d.Mode())
	}
}
