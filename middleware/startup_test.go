package middleware_test

// Fail fast: NewDedup refuses, at start-up rather than at the
// first message, a missing table, a table keyed the reference document's
// way, and pending migrations, each with a typed error.

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func TestNewDedupChecksTheTableAtStartup(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, db *pgtest.DB, table deduplicator.TableConfig)
		want  error
	}{
		{"no table", func(*testing.T, *pgtest.DB, deduplicator.TableConfig) {}, deduplicator.ErrTableMissing},
		{"reference DDL: PRIMARY KEY (event_id)", func(t *testing.T, db *pgtest.DB, _ deduplicator.TableConfig) {
			db.Exec(t, `CREATE TABLE processed_event (event_id uuid PRIMARY KEY, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now())`)
		}, deduplicator.ErrTableKey},
		{"reference TTL variant: partitioned by processed_at", func(t *testing.T, db *pgtest.DB, _ deduplicator.TableConfig) {
			db.Exec(t, `CREATE TABLE processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
				PRIMARY KEY (event_id, processed_at)) PARTITION BY RANGE (processed_at)`)
		}, deduplicator.ErrTableKey},
		{"migration 2 pending", func(t *testing.T, db *pgtest.DB, table deduplicator.TableConfig) {
			require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(table)))
			db.Exec(t, `DROP TABLE processed_event_group, processed_event_setting`)
			db.Exec(t, `DELETE FROM idem_schema_migration WHERE version = 2`)
		}, migrate.ErrMigrationsPending},
		{"partitioned table, plain layout configured", func(t *testing.T, db *pgtest.DB, table deduplicator.TableConfig) {
			table.Layout = deduplicator.LayoutPartitioned
			require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(table)))
		}, deduplicator.ErrLayoutMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t, 2)
			table := deduplicator.TableConfig{Schema: db.Schema}
			tc.setup(t, db, table)
			_, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, "start-up check")
		})
	}
}
