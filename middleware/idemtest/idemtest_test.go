package idemtest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func setup(t *testing.T, group string) (*pgtest.DB, deduplicator.TableConfig, *idem.Dedup) {
	t.Helper()
	db := pgtest.New(t, 10)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, `CREATE TABLE ledger (event_id uuid NOT NULL, amount int NOT NULL)`)
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: group, Table: table}, nil)
	require.NoError(t, err)
	return db, table, dedup
}

func newMsg(id uuid.UUID) *message.Message {
	m := message.NewMessage(id.String(), []byte(`{"amount":7}`))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	return m
}

// txHandler writes its effect in the middleware's transaction (correct).
func txHandler(msg *message.Message) ([]*message.Message, error) {
	id, _ := idem.EventIDFromContext(msg.Context())
	_, err := idem.MustTxFromContext(msg.Context()).Exec(msg.Context(), `INSERT INTO ledger VALUES ($1, 7)`, id)
	return nil, err
}

// failTB records Fatalf instead of stopping the real test.
type failTB struct {
	testing.TB
	failed string
}

type fatal struct{}

func (f *failTB) Helper() {}
func (f *failTB) Fatalf(format string, args ...any) {
	f.failed = fmt.Sprintf(format, args...)
	panic(fatal{})
}

// expectFatal runs fn with a recording TB and returns the failure message.
func expectFatal(t *testing.T, fn func(tb testing.TB)) string {
	t.Helper()
	tb := &failTB{TB: t}
	func() {
		defer func() {
			if r := recover(); r != nil {
				if _, ok := r.(fatal); !ok {
					panic(r)
				}
			}
		}()
		fn(tb)
	}()
	require.NotEmpty(t, tb.failed, "expected the helper to fail the test")
	return tb.failed
}

func TestRunWithRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		opts *idemtest.RedeliveryOpts
		runs int
	}{
		{"defaults", nil, 1},
		{"sequential", &idemtest.RedeliveryOpts{Deliveries: 3, Concurrency: 1}, 1},
		{"concurrent", &idemtest.RedeliveryOpts{Deliveries: 8, Concurrency: 8}, 1},
		{"rollback first", &idemtest.RedeliveryOpts{Deliveries: 4, Concurrency: 2, RollbackFirst: true}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, table, dedup := setup(t, "billing")
			id := publisher.NewEventID()
			res := idemtest.RunWithRedelivery(ctx, t, dedup, txHandler, newMsg(id), tc.opts)
			require.Equal(t, id, res.EventID)
			require.Equal(t, 1, res.Committed)
			require.Equal(t, tc.runs, res.HandlerRuns)
			require.Equal(t, res.Deliveries-res.HandlerRuns, res.Duplicates)
			require.Equal(t, 1, db.Count(t, `SELECT 1 FROM ledger WHERE event_id = $1`, id))
			idemtest.RequireProcessed(ctx, t, db.Pool, table, "billing", id)
			idemtest.RequireNotProcessed(ctx, t, db.Pool, table, "shipping", id)
		})
	}
}

// A handler that writes through the pool instead of the middleware's
// transaction keeps its effect after the injected rollback: the runner
// exposes it as a second ledger row.
func TestRunWithRedeliveryExposesWritesOutsideTheTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _, dedup := setup(t, "billing")
	wrong := func(msg *message.Message) ([]*message.Message, error) {
		id, _ := idem.EventIDFromContext(msg.Context())
		_, err := db.Pool.Exec(msg.Context(), `INSERT INTO ledger VALUES ($1, 7)`, id)
		return nil, err
	}
	id := publisher.NewEventID()
	res := idemtest.RunWithRedelivery(ctx, t, dedup, wrong, newMsg(id), &idemtest.RedeliveryOpts{RollbackFirst: true})
	require.Equal(t, 1, res.InjectedRollbacks)
	require.Equal(t, 2, db.Count(t, `SELECT 1 FROM ledger WHERE event_id = $1`, id), "the non-transactional write survived the rollback")
}

func TestRunWithRedeliveryFailsOnHandlerError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, dedup := setup(t, "billing")
	failing := func(*message.Message) ([]*message.Message, error) { return nil, fmt.Errorf("boom") }
	msg := expectFatal(t, func(tb testing.TB) {
		idemtest.RunWithRedelivery(ctx, tb, dedup, failing, newMsg(publisher.NewEventID()), nil)
	})
	require.Contains(t, msg, "boom")
}

func TestRunWithRedeliveryFailsOnBadEventID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, dedup := setup(t, "billing")
	bad := message.NewMessage("x", []byte(`{}`))
	msg := expectFatal(t, func(tb testing.TB) {
		idemtest.RunWithRedelivery(ctx, tb, dedup, txHandler, bad, nil)
	})
	require.Contains(t, msg, "event id missing")
}

func TestRequireProcessedFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, table, dedup := setup(t, "billing")
	id := publisher.NewEventID()
	msg := expectFatal(t, func(tb testing.TB) { idemtest.RequireProcessed(ctx, tb, db.Pool, table, "billing", id) })
	require.Contains(t, msg, "was not processed")

	idemtest.RunWithRedelivery(ctx, t, dedup, txHandler, newMsg(id), nil)
	msg = expectFatal(t, func(tb testing.TB) { idemtest.RequireNotProcessed(ctx, tb, db.Pool, table, "billing", id) })
	require.Contains(t, msg, "expected it not to be")

	msg = expectFatal(t, func(tb testing.TB) {
		idemtest.RequireProcessed(ctx, tb, db.Pool, deduplicator.TableConfig{Schema: "x; DROP TABLE y"}, "billing", id)
	})
	require.Contains(t, msg, "not a plain identifier")
}

// Given the transaction, the helpers see its own uncommitted claim; given
// the pool, only committed ones.
func TestRequireProcessedInTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, table, dedup := setup(t, "billing")
	id := publisher.NewEventID()
	d, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: dedup.ConsumerGroup()}, nil)
	require.NoError(t, err)
	tx, first, err := d.BeginClaim(ctx, db.Pool, pgx.TxOptions{}, id)
	require.NoError(t, err)
	require.True(t, first)
	defer func() { _ = tx.Rollback(ctx) }()
	idemtest.RequireProcessed(ctx, t, tx, table, "billing", id)
	idemtest.RequireNotProcessed(ctx, t, tx, table, "shipping", id)
	idemtest.RequireNotProcessed(ctx, t, db.Pool, table, "billing", id)
	msg := expectFatal(t, func(tb testing.TB) { idemtest.RequireNotProcessed(ctx, tb, tx, table, "billing", id) })
	require.Contains(t, msg, "expected it not to be")
}

// A lease-mode handler under redelivery, a takeover of its first run
// included: one ledger row, the first run's completion refused.
func TestRunWithRedeliveryLeaseMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, table, _ := setup(t, "billing")
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table, Mode: &idem.LeaseConfig{Concurrency: 2}}, nil)
	require.NoError(t, err)
	leaseHandler := func(msg *message.Message) ([]*message.Message, error) {
		if _, ok := idem.TxFromContext(msg.Context()); ok {
			return nil, errors.New("lease mode gave the handler a transaction")
		}
		return nil, idem.Complete(msg.Context(), func(ctx context.Context, tx pgx.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, 7)`, id)
			return err
		})
	}
	for name, opts := range map[string]*idemtest.RedeliveryOpts{
		"concurrent":      {Deliveries: 6, Concurrency: 3},
		"take over first": {Deliveries: 3, Concurrency: 1, TakeOverFirst: true, DB: db.Pool, Table: table},
	} {
		t.Run(name, func(t *testing.T) {
			id := publisher.NewEventID()
			res := idemtest.RunWithRedelivery(ctx, t, dedup, leaseHandler, newMsg(id), opts)
			require.Equal(t, 1, res.Committed)
			require.Equal(t, map[bool]int{true: 1}[opts.TakeOverFirst], res.TakenOver)
			require.Equal(t, 1, db.Count(t, `SELECT 1 FROM ledger WHERE event_id = $1`, id))
			idemtest.RequireProcessed(ctx, t, db.Pool, table, "billing", id)
		})
	}
	expectFatal(t, func(tb testing.TB) {
		idemtest.RunWithRedelivery(ctx, tb, dedup, leaseHandler, newMsg(publisher.NewEventID()), &idemtest.RedeliveryOpts{TakeOverFirst: true})
	})
}
