package outbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// requireOutboxTableError asserts err is a *TableError of topic and table
// with the reason, whose one-line message names problem and fix.
func requireOutboxTableError(t *testing.T, err error, reason error, topic, table string) *migrate.TableError {
	t.Helper()
	require.ErrorIs(t, err, reason)
	var terr *migrate.TableError
	require.ErrorAs(t, err, &terr)
	require.Equal(t, "outbox: topic "+topic, terr.Component)
	require.Equal(t, table, terr.Table)
	require.NotEmpty(t, terr.Problem)
	require.NotEmpty(t, terr.Fix)
	require.NotContains(t, err.Error(), "\n")
	require.Contains(t, err.Error(), "fix: "+terr.Fix)
	for _, other := range []error{outbox.ErrTopicNotMigrated, outbox.ErrTableShape, migrate.ErrMigrationsPending} {
		if other != reason {
			require.False(t, errors.Is(err, other))
		}
	}
	return terr
}

func TestCheck_MigratedTopicsPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2, "orders", "orders.v2")
	require.NoError(t, e.outbox.Check(ctx, e.db.Pool))
	require.NoError(t, e.outbox.Check(ctx, e.db.Pool, "orders.v2"))
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, e.outbox.Check(ctx, tx))
}

func TestCheck_MissingTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2, "orders")

	err := e.outbox.Check(ctx, e.db.Pool, "payments")
	terr := requireOutboxTableError(t, err, outbox.ErrTopicNotMigrated, "payments", e.outbox.MessagesTable("payments"))
	require.Contains(t, terr.Fix, "outbox.MigrationLine")

	e.db.Exec(t, "DROP TABLE "+outbox.OffsetsTable(e.outbox, "orders"))
	requireOutboxTableError(t, e.outbox.Check(ctx, e.db.Pool), outbox.ErrTopicNotMigrated, "orders", outbox.OffsetsTable(e.outbox, "orders"))

	require.ErrorIs(t, e.outbox.Check(ctx, e.db.Pool, "bad;topic"), outbox.ErrInvalidTopic)
}

func TestCheck_TableShape(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		alter   func(o *outbox.Outbox) string
		table   func(o *outbox.Outbox) string
		problem string
	}{
		"no transaction_id": {
			alter: func(o *outbox.Outbox) string {
				return "ALTER TABLE " + o.MessagesTable("orders") + " DROP COLUMN transaction_id"
			},
			table:   func(o *outbox.Outbox) string { return o.MessagesTable("orders") },
			problem: "has no transaction_id column",
		},
		"transaction_id bigint": {
			alter: func(o *outbox.Outbox) string {
				return "ALTER TABLE " + outbox.OffsetsTable(o, "orders") + " ALTER COLUMN last_processed_transaction_id TYPE bigint USING last_processed_transaction_id::text::bigint"
			},
			table:   func(o *outbox.Outbox) string { return outbox.OffsetsTable(o, "orders") },
			problem: "last_processed_transaction_id is bigint, want xid8",
		},
		"offsets without key": {
			alter: func(o *outbox.Outbox) string {
				return "ALTER TABLE " + outbox.OffsetsTable(o, "orders") + " DROP CONSTRAINT \"outbox_orders__offsets_pkey\""
			},
			table:   func(o *outbox.Outbox) string { return outbox.OffsetsTable(o, "orders") },
			problem: "unique index on consumer_group",
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 2, "orders")
			e.db.Exec(t, tc.alter(e.outbox))
			terr := requireOutboxTableError(t, e.outbox.Check(ctx, e.db.Pool), outbox.ErrTableShape, "orders", tc.table(e.outbox))
			require.Contains(t, terr.Problem, tc.problem)
		})
	}
}

// Migrate verifies what CREATE TABLE IF NOT EXISTS kept: a table made for
// another payload type, or by an older layout, fails it, and nothing of the
// migration is committed.
func TestMigrate_RefusesTablesOfAnotherShape(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2, "orders")
	jsonb, err := outbox.New(outbox.Config{Schema: e.db.Schema, Topics: []string{"orders", "invoices"}, PayloadType: "JSONB"}, nil)
	require.NoError(t, err)
	terr := requireOutboxTableError(t, migrate.Up(ctx, e.db.Pool, outbox.MigrationLine(jsonb.Config(), "orders"), outbox.MigrationLine(jsonb.Config(), "invoices")), outbox.ErrTableShape, "orders", jsonb.MessagesTable("orders"))
	require.Contains(t, terr.Problem, "payload is bytea but Config.PayloadType is JSONB")
	requireOutboxTableError(t, jsonb.Check(ctx, e.db.Pool, "invoices"), outbox.ErrTopicNotMigrated, "invoices", jsonb.MessagesTable("invoices"))

	// watermill-sql v2's layout had no transaction_id.
	e.db.Exec(t, `CREATE TABLE "outbox_legacy" ("offset" SERIAL PRIMARY KEY, uuid VARCHAR(36) NOT NULL, created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, payload BYTEA, metadata JSON)`)
	requireOutboxTableError(t, migrateTopics(ctx, e.db.Pool, e.outbox, "legacy"), outbox.ErrTableShape, "legacy", e.outbox.MessagesTable("legacy"))
	require.Zero(t, e.db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'outbox_legacy__offsets'", e.db.Schema), "rolled back")
}

// The forwarder fails at construction, not at its first batch, when a
// topic's tables are missing or of another shape.
func TestNewForwarder_ChecksTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2, "orders")
	cfg := outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Publisher: refusingPublisher{t}}

	f, err := outbox.NewForwarder(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	cfg.Topics = []string{"orders", "payments"}
	_, err = outbox.NewForwarder(cfg, nil)
	requireOutboxTableError(t, err, outbox.ErrTopicNotMigrated, "payments", e.outbox.MessagesTable("payments"))

	cfg.Topics = nil
	e.db.Exec(t, "ALTER TABLE "+e.outbox.MessagesTable("orders")+" DROP COLUMN transaction_id")
	_, err = outbox.NewForwarder(cfg, nil)
	requireOutboxTableError(t, err, outbox.ErrTableShape, "orders", e.outbox.MessagesTable("orders"))

	cfg.StartupCheckTimeout = -1
	_, err = outbox.NewForwarder(cfg, nil)
	require.ErrorContains(t, err, "StartupCheckTimeout")

	// A database that cannot be used fails construction too.
	closed, err := pgxpool.New(ctx, e.db.URL)
	require.NoError(t, err)
	closed.Close()
	cfg.StartupCheckTimeout, cfg.DB = 0, closed
	_, err = outbox.NewForwarder(cfg, nil)
	require.ErrorContains(t, err, "outbox forwarder: check tables")
}
