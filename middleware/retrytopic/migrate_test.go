package retrytopic_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The Migrator has the shape of deduplicator's and outbox's: Validate lists
// the pending version, Migrate up applies it once, down reverts it (the
// table is gone and New refuses KeyOrder again).
func TestMigrator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	table := retrytopic.ParkedKeysTable{Schema: db.Schema}
	m, err := migrate.New(db.Pool, retrytopic.MigrationLine(table))
	require.NoError(t, err)

	v, err := m.Validate(ctx)
	require.NoError(t, err)
	require.False(t, v.OK)
	require.Len(t, v.Pending, 1)
	require.Equal(t, "retry_parked_key:retry_parked_key", v.Pending[0].Component)

	res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 1)
	require.Equal(t, 1, res.Versions[0].Version)
	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, res.Versions, "nothing left to apply")
	v, err = m.Validate(ctx)
	require.NoError(t, err)
	require.True(t, v.OK)

	res, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 1)
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = 'retry_parked_key'", db.Schema))

	_, err = migrate.New(db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Table: "no good"}))
	require.ErrorContains(t, err, "retrytopic: invalid config: Table:")
}
