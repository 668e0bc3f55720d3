package idemtest_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// sqlTxHandler writes its effect through the *sql.Tx (idem.CompleteSQL:
// at once in transaction mode, in the completion in lease mode).
func sqlTxHandler(msg *message.Message) ([]*message.Message, error) {
	return nil, idem.CompleteSQL(msg.Context(), func(ctx context.Context, tx *sql.Tx) error {
		id, _ := idem.EventIDFromContext(ctx)
		_, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES ($1, 7)`, id.String())
		return err
	})
}

// The kit works for a middleware on a *sql.DB (idem.SQLDB) as on a pool,
// in transaction and lease mode, and its assertions take the same value.
func TestRunWithRedeliverySQLDB(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, lease := range []bool{false, true} {
		t.Run(map[bool]string{false: "transaction mode", true: "lease mode"}[lease], func(t *testing.T) {
			t.Parallel()
			pdb := pgtest.New(t, 2)
			table := deduplicator.TableConfig{Schema: pdb.Schema}
			require.NoError(t, migrate.Up(ctx, pdb.Pool, deduplicator.MigrationLine(table)))
			pdb.Exec(t, `CREATE TABLE ledger (event_id uuid NOT NULL, amount int NOT NULL)`)
			db, err := idem.SQLDB(pdb.SQLDB(t, 8, nil))
			require.NoError(t, err)
			cfg := idem.Config{DB: db, ConsumerGroup: "billing", Table: table}
			if lease {
				cfg.Mode = &idem.LeaseConfig{Concurrency: 2}
			}
			dedup, err := idem.NewDedup(cfg, nil)
			require.NoError(t, err)
			id := publisher.NewEventID()
			res := idemtest.RunWithRedelivery(ctx, t, dedup, sqlTxHandler, newMsg(id),
				&idemtest.RedeliveryOpts{Deliveries: 4, Concurrency: 2, RollbackFirst: true})
			require.Equal(t, 1, res.Committed)
			require.Equal(t, 1, pdb.Count(t, `SELECT 1 FROM ledger WHERE event_id = $1`, id))
			idemtest.RequireProcessed(ctx, t, db, table, "billing", id)
			idemtest.RequireNotProcessed(ctx, t, db, table, "shipping", id)
		})
	}
}
