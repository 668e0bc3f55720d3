package orm_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/examples/orm"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// handlers builds each ORM's handler on the same *sql.DB.
var handlers = map[string]func(t *testing.T, sdb *sql.DB) message.NoPublishHandlerFunc{
	"gorm": func(t *testing.T, sdb *sql.DB) message.NoPublishHandlerFunc {
		db, err := gorm.Open(postgres.New(postgres.Config{Conn: sdb}), &gorm.Config{Logger: logger.Discard})
		require.NoError(t, err)
		return orm.GORMHandler(db)
	},
	"bun": func(t *testing.T, sdb *sql.DB) message.NoPublishHandlerFunc {
		return orm.BunHandler(bun.NewDB(sdb, pgdialect.New()))
	},
	"ent": func(*testing.T, *sql.DB) message.NoPublishHandlerFunc {
		return orm.EntHandler()
	},
	"sqlx": func(t *testing.T, sdb *sql.DB) message.NoPublishHandlerFunc {
		return orm.SQLXHandler(sqlx.NewDb(sdb, "pgx"))
	},
}

// Each ORM's handler, behind the dedup middleware on a *sql.DB, against
// PostgreSQL: the first run is rolled back (its row must vanish with the
// claim), the redelivery applies the payment once, concurrent duplicates
// run nothing; in transaction mode and in lease mode (the same handler).
func TestORMHandlersApplyOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"transaction", "lease"} {
		for name, build := range handlers {
			t.Run(mode+"/"+name, func(t *testing.T) {
				t.Parallel()
				ormApplyOnce(t, mode == "lease", build)
			})
		}
	}
}

func ormApplyOnce(t *testing.T, lease bool, build func(*testing.T, *sql.DB) message.NoPublishHandlerFunc) {
	ctx := context.Background()
	pdb := pgtest.New(t, 2)
	table := deduplicator.TableConfig{Schema: pdb.Schema}
	require.NoError(t, migrate.Up(ctx, pdb.Pool, deduplicator.MigrationLine(table)))
	pdb.Exec(t, orm.Schema)
	sdb := pdb.SQLDB(t, 4, nil)
	db, err := idem.SQLDB(sdb)
	require.NoError(t, err)
	cfg := idem.Config{DB: db, ConsumerGroup: "payments", Table: table}
	if lease {
		cfg.Mode = &idem.LeaseConfig{Concurrency: 1}
	}
	dedup, err := idem.NewDedup(cfg, nil)
	require.NoError(t, err)
	h := build(t, sdb)

	id := publisher.NewEventID()
	msg := message.NewMessage(id.String(), []byte(`{"orderId":"o-1","amount":4200}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	res := idemtest.RunWithRedelivery(ctx, t, dedup, func(m *message.Message) ([]*message.Message, error) {
		return nil, h(m)
	}, msg, &idemtest.RedeliveryOpts{Deliveries: 4, Concurrency: 2, RollbackFirst: true})
	require.Equal(t, 1, res.InjectedRollbacks)
	require.Equal(t, 1, res.Committed)

	var orderID string
	var amount int64
	require.NoError(t, pdb.Pool.QueryRow(ctx, "SELECT order_id, amount FROM payments WHERE event_id = $1", id).Scan(&orderID, &amount))
	require.Equal(t, "o-1", orderID)
	require.EqualValues(t, 4200, amount)
	require.Equal(t, 1, pdb.Count(t, "SELECT 1 FROM payments"))
	idemtest.RequireProcessed(ctx, t, db, table, "payments", id)
	require.Zero(t, sdb.Stats().InUse)
}
