package retrytopic_test

import (
	"context"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	require.Len(t, v.Pending, 2)
	require.Equal(t, "retry_parked_key:retry_parked_key", v.Pending[0].Component)

	res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 2)
	require.Equal(t, 1, res.Versions[0].Version)
	require.Equal(t, 2, res.Versions[1].Version)
	res, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, res.Versions, "nothing left to apply")
	v, err = m.Validate(ctx)
	require.NoError(t, err)
	require.True(t, v.OK)

	// Version 2 refuses to go down while an event waits in the table with
	// its message only (version 1 would lose it).
	db.Exec(t, `INSERT INTO `+pgx.Identifier{db.Schema, "retry_parked_key"}.Sanitize()+
		` (consumer_group, partition_key, event_id, payload, metadata) VALUES ('g', 'k', gen_random_uuid(), '', '{}')`)
	_, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.ObjectInUse, pgErr.Code)
	db.Exec(t, `DELETE FROM `+pgx.Identifier{db.Schema, "retry_parked_key"}.Sanitize())

	res, err = m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: -1})
	require.NoError(t, err)
	require.Len(t, res.Versions, 2)
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = 'retry_parked_key'", db.Schema))

	_, err = migrate.New(db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Table: "no good"}))
	require.ErrorContains(t, err, "retrytopic: invalid config: Table:")
}
