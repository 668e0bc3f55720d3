package middleware_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/lib/pq" // a database/sql driver other than pgx's, to be refused
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// sqlDedup returns a middleware for group on a *sql.DB (pgx's stdlib
// driver) of the fixture's schema.
func (f *ledgerFixture) sqlDedup(t *testing.T, sdb *sql.DB, group string, mod func(*idem.Config)) *idem.Dedup {
	t.Helper()
	db, err := idem.SQLDB(sdb)
	require.NoError(t, err)
	return f.dedup(t, group, func(c *idem.Config) {
		c.DB = db
		if mod != nil {
			mod(c)
		}
	})
}

// sqlInsertHandler writes one ledger row through the *sql.Tx the
// middleware hands the handler, and counts its calls.
func sqlInsertHandler(calls *atomic.Int32, fail error) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		ctx := m.Context()
		tx := idem.MustSQLTxFromContext(ctx)
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := tx.ExecContext(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'g', 1)", id.String()); err != nil {
			return nil, err
		}
		return nil, fail
	}
}

// On a *sql.DB the handler's *sql.Tx is the claim's transaction: the
// same session and transaction id, the claim visible in it; a failing
// handler leaves neither its row nor the claim, the redelivery processes
// once, a duplicate runs nothing, and every connection goes back.
func TestSQLDBTransactionMode(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	sdb := f.db.SQLDB(t, 4, nil)
	d := f.sqlDedup(t, sdb, "g", nil)
	id := publisher.NewEventID()
	var calls atomic.Int32

	_, err := d.Middleware(sqlInsertHandler(&calls, errors.New("fail once")))(f.msg(id))
	require.ErrorContains(t, err, "fail once")
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.claims(t))

	var sameXact, claimSeen bool
	_, err = d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		stx := idem.MustSQLTxFromContext(ctx)
		ptx := idem.MustTxFromContext(ctx)
		var a, b string
		if err := stx.QueryRowContext(ctx, "SELECT pg_current_xact_id()::text").Scan(&a); err != nil {
			return nil, err
		}
		if err := ptx.QueryRow(ctx, "SELECT pg_current_xact_id()::text").Scan(&b); err != nil {
			return nil, err
		}
		sameXact = a == b
		if err := stx.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM processed_event WHERE event_id = $1)", id.String()).Scan(&claimSeen); err != nil {
			return nil, err
		}
		return sqlInsertHandler(&calls, nil)(m)
	})(f.msg(id))
	require.NoError(t, err)
	require.True(t, sameXact, "the *sql.Tx and the library's pgx.Tx are one transaction")
	require.True(t, claimSeen, "the uncommitted claim is visible in the handler's *sql.Tx")

	_, err = d.Middleware(sqlInsertHandler(&calls, nil))(f.msg(id))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load(), "the failed attempt and the redelivery; the duplicate ran nothing")
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.claims(t))
	require.Zero(t, sdb.Stats().InUse, "every connection is back in the *sql.DB's pool")
}

// A *sql.DB of another driver is refused at start-up with a typed error;
// on a pgx pool the database/sql accessors say what to do.
func TestSQLDBRefusesOtherDrivers(t *testing.T) {
	t.Parallel()
	pq, err := sql.Open("postgres", pgtest.URL())
	require.NoError(t, err)
	defer pq.Close()
	_, err = idem.SQLDB(pq)
	require.ErrorIs(t, err, idem.ErrUnsupportedDriver)

	f := newLedgerFixture(t)
	d := f.dedup(t, "g", nil) // a pgx pool
	_, err = d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		_, ok := idem.SQLTxFromContext(m.Context())
		require.False(t, ok)
		require.PanicsWithError(t, idem.ErrNotInHandler.Error()+": the middleware's Config.DB is not a *sql.DB (wrap it with idem.SQLDB); use idem.TxFromContext for its pgx.Tx", func() {
			idem.MustSQLTxFromContext(m.Context())
		})
		return nil, idem.CompleteSQL(m.Context(), func(context.Context, *sql.Tx) error { return nil })
	})(f.msg(publisher.NewEventID()))
	require.ErrorIs(t, err, idem.ErrNotInHandler)
	require.Panics(t, func() { idem.MustSQLTxFromContext(context.Background()) })
}

// Round trips per message on a *sql.DB, counted at the net.Conn level:
// one more than on a pgx pool (database/sql sends BEGIN alone), for a
// first delivery and for a duplicate.
func TestSQLDBRoundTrips(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	counts := map[string][2]int64{}
	for _, name := range []string{"pgx", "sql"} {
		rt := &rtcount.Counter{}
		var db migrate.Beginner = f.db.CountingPool(t, 1, rt)
		if name == "sql" {
			var err error
			db, err = idem.SQLDB(f.db.SQLDB(t, 1, rt))
			require.NoError(t, err)
		}
		d := f.dedup(t, "rt_"+name, func(c *idem.Config) { c.DB = db })
		h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
			tx, _ := idem.TxFromContext(m.Context())
			_, err := tx.Exec(m.Context(), "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'rt', 1)", uuid.New())
			return nil, err
		})
		id := publisher.NewEventID()
		_, err := h(f.msg(id)) // warms the connection and the statement cache
		require.NoError(t, err)
		id = publisher.NewEventID()
		rt.Reset()
		_, err = h(f.msg(id))
		require.NoError(t, err)
		first := rt.Load()
		rt.Reset()
		_, err = h(f.msg(id))
		require.NoError(t, err)
		counts[name] = [2]int64{first, rt.Load()}
	}
	t.Logf("round trips (first, duplicate): pgx %v, database/sql %v", counts["pgx"], counts["sql"])
	require.Equal(t, [2]int64{3, 2}, counts["pgx"], "BEGIN+claim, INSERT, COMMIT; BEGIN+claim, ROLLBACK")
	require.Equal(t, [2]int64{4, 3}, counts["sql"], "BEGIN, claim, INSERT, COMMIT; BEGIN, claim, ROLLBACK")
}

// Group commit on a *sql.DB: a group's handlers write on its *sql.Tx
// (Exec at once), or register the row with CompleteExec, gathered into the
// group's pipeline, which travels on database/sql's connection through
// pgx; every row commits with its claim, the duplicates run nothing, and
// every connection goes back.
func TestSQLDBGroupCommit(t *testing.T) {
	t.Parallel()
	completeExec := func(calls *atomic.Int32) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			id, _ := idem.EventIDFromContext(m.Context())
			return nil, idem.CompleteExec(m.Context(), "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'g', 1)", id.String())
		}
	}
	for name, handler := range map[string]func(*atomic.Int32) message.HandlerFunc{
		"Exec on the tx": func(calls *atomic.Int32) message.HandlerFunc { return sqlInsertHandler(calls, nil) },
		"CompleteExec":   completeExec,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			sdb := f.db.SQLDB(t, 4, nil)
			d := f.sqlDedup(t, sdb, "g", func(c *idem.Config) {
				c.Mode = &idem.GroupCommitConfig{MaxMessages: 8, MaxWait: 20 * time.Millisecond, Concurrency: 2}
			})
			var calls atomic.Int32
			h := d.Middleware(handler(&calls))
			ids := make([]uuid.UUID, 8)
			for i := range ids {
				ids[i] = publisher.NewEventID()
			}
			run := func() {
				var wg sync.WaitGroup
				errs := make([]error, len(ids))
				for i, id := range ids {
					wg.Go(func() { _, errs[i] = h(f.msg(id)) })
				}
				wg.Wait()
				require.NoError(t, errors.Join(errs...))
			}
			run()
			run() // all duplicates
			require.EqualValues(t, len(ids), calls.Load())
			require.Equal(t, len(ids), f.ledgerRows(t))
			require.Equal(t, len(ids), f.claims(t))
			require.Zero(t, sdb.Stats().InUse)
		})
	}
}

// Lease mode on a *sql.DB: the handler holds no transaction, and the
// writes it registers with CompleteSQL commit with the completion, on
// the fast path and off it.
func TestSQLDBLeaseMode(t *testing.T) {
	t.Parallel()
	for _, fastPath := range []time.Duration{0, -1} {
		t.Run(map[time.Duration]string{0: "fast path", -1: "two phases"}[fastPath], func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			sdb := f.db.SQLDB(t, 6, nil)
			d := f.sqlDedup(t, sdb, "g", func(c *idem.Config) { c.Mode = &idem.LeaseConfig{Concurrency: 2, FastPath: fastPath} })
			var calls atomic.Int32
			h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				ctx := m.Context()
				_, ok := idem.SQLTxFromContext(ctx)
				require.False(t, ok, "lease mode: no transaction while the handler runs")
				require.PanicsWithError(t, idem.ErrNotInHandler.Error()+": lease mode (Config.Mode: a *LeaseConfig) runs the handler without a transaction; register its writes with idem.CompleteSQL", func() {
					idem.MustSQLTxFromContext(ctx)
				})
				id, _ := idem.EventIDFromContext(ctx)
				return nil, idem.CompleteSQL(ctx, func(ctx context.Context, tx *sql.Tx) error {
					_, err := tx.ExecContext(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'g', 1)", id.String())
					return err
				})
			})
			id := publisher.NewEventID()
			_, err := h(f.msg(id))
			require.NoError(t, err)
			_, err = h(f.msg(id))
			require.NoError(t, err)
			require.EqualValues(t, 1, calls.Load())
			require.Equal(t, 1, f.ledgerRows(t))
			require.Equal(t, 1, f.claims(t))
			require.Zero(t, sdb.Stats().InUse)
		})
	}
}

// The outbox on a *sql.Tx: on the middleware's transaction the rows commit
// or vanish with the claim; on a transaction of the caller's own, with it.
func TestSQLDBOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	ob, err := outbox.New(outbox.Config{Schema: f.db.Schema}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, f.db.Pool, outbox.MigrationLine(ob.Config(), "orders")))
	sdb := f.db.SQLDB(t, 2, nil)
	d := f.sqlDedup(t, sdb, "g", nil)
	handler := func(fail error) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out := message.NewMessage(uuid.NewString(), []byte(`{}`))
			out.SetContext(m.Context())
			if err := ob.SQLPublisher(idem.MustSQLTxFromContext(m.Context())).Publish("orders", out); err != nil {
				return nil, err
			}
			return nil, fail
		}
	}
	rows := func() int { return f.db.Count(t, "SELECT 1 FROM "+ob.MessagesTable("orders")) }
	id := publisher.NewEventID()
	_, err = d.Middleware(handler(errors.New("boom")))(f.msg(id))
	require.Error(t, err)
	require.Zero(t, rows())
	_, err = d.Middleware(handler(nil))(f.msg(id))
	require.NoError(t, err)
	require.Equal(t, 1, rows())
	var causation string
	require.NoError(t, f.db.Pool.QueryRow(ctx, "SELECT metadata->>'causation_id' FROM "+ob.MessagesTable("orders")).Scan(&causation))
	require.Equal(t, id.String(), causation)

	tx, err := sdb.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, ob.SQLPublisher(tx).Publish("orders", message.NewMessage(uuid.NewString(), []byte(`{}`))))
	require.NoError(t, tx.Rollback())
	require.Equal(t, 1, rows(), "rolled back with the caller's transaction")
	tx, err = sdb.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, ob.SQLPublisher(tx).Publish("orders", message.NewMessage(uuid.NewString(), []byte(`{}`))))
	require.NoError(t, tx.Commit())
	require.Equal(t, 2, rows())
}

// The table and the pool are checked on a *sql.DB as on a pool.
func TestSQLDBStartupChecks(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	db, err := idem.SQLDB(f.db.SQLDB(t, 2, nil))
	require.NoError(t, err)
	_, err = idem.NewDedup(idem.Config{DB: db, ConsumerGroup: "g", Concurrency: 3}, nil)
	require.ErrorIs(t, err, idem.ErrPoolTooSmall)
	_, err = idem.NewDedup(idem.Config{DB: db, ConsumerGroup: "g", Table: deduplicator.TableConfig{Schema: f.db.Schema, Table: "missing"}}, nil)
	require.Error(t, err)
}

// A handler that swallows a failed statement of its *sql.Tx and returns
// nil is caught as on pgx: ErrTxAborted, rolled back, nothing applied.
func TestSQLDBSwallowedErrorIsTxAborted(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	sdb := f.db.SQLDB(t, 2, nil)
	d := f.sqlDedup(t, sdb, "g", nil)
	var calls atomic.Int32
	_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if _, err := sqlInsertHandler(&calls, nil)(m); err != nil {
			return nil, err
		}
		_, _ = idem.MustSQLTxFromContext(m.Context()).ExecContext(m.Context(), "SELECT 1/0") // swallowed
		return nil, nil
	})(f.msg(publisher.NewEventID()))
	require.ErrorIs(t, err, idem.ErrTxAborted)
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.claims(t))
	require.Zero(t, sdb.Stats().InUse)
}

// CompleteExec on a *sql.DB in lease mode: the pipelined completion
// travels on database/sql's connection, through pgx, in both paths.
func TestSQLDBLeaseModeCompleteExec(t *testing.T) {
	t.Parallel()
	for _, fastPath := range []time.Duration{0, -1} {
		t.Run(map[time.Duration]string{0: "fast path", -1: "two phases"}[fastPath], func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			sdb := f.db.SQLDB(t, 6, nil)
			d := f.sqlDedup(t, sdb, "g", func(c *idem.Config) { c.Mode = &idem.LeaseConfig{Concurrency: 2, FastPath: fastPath} })
			var calls atomic.Int32
			h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				id, _ := idem.EventIDFromContext(m.Context())
				return nil, idem.CompleteExec(m.Context(), "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'g', 1)", id)
			})
			id := publisher.NewEventID()
			for range 2 {
				_, err := h(f.msg(id))
				require.NoError(t, err)
			}
			require.EqualValues(t, 1, calls.Load())
			require.Equal(t, 1, f.ledgerRows(t))
			require.Equal(t, 1, f.claims(t))
			require.Zero(t, f.leases(t))
			require.Zero(t, sdb.Stats().InUse)
		})
	}
}
