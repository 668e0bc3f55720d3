package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// ledgerExec is a CompleteExec ledger write of amount 2 (transaction
// mode's insertHandler writes 1).
const ledgerExec = "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 2)"

// execBatch runs n+1 deliveries of CompleteExec handlers on d as one
// completion batch (two phases: the opener's completion holds the only
// slot until the others are queued; fast path: the opener's handler waits
// until the others' takes are queued). odd, the last one, runs odd(ctx,
// id) in its call; every handler then registers ledgerExec, and odd a
// second statement, sql (when not empty). It returns the ids and errors.
func execBatch(t *testing.T, f *ledgerFixture, d *idem.Dedup, fast bool, n int, odd func(ctx context.Context, id uuid.UUID), oddSQL string) ([]uuid.UUID, []error) {
	t.Helper()
	ids := append(newIDs(n), publisher.NewEventID())
	opener, last := ids[0], ids[n]
	firstPaused, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	if !fast {
		idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
			if point == "completing" {
				once.Do(func() {
					close(firstPaused)
					<-release
				})
			}
		})
		go func() {
			<-firstPaused
			for idem.LeaseCompletionsQueued(d) < n {
				time.Sleep(time.Millisecond)
			}
			close(release)
		}()
	}
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		switch {
		case fast && id == opener:
			for idem.LeaseTakesQueued(d) < n {
				time.Sleep(time.Millisecond)
			}
		case !fast && id != opener:
			<-firstPaused
		}
		if id == last && odd != nil {
			odd(ctx, id)
		}
		if err := idem.CompleteExec(ctx, ledgerExec, id); err != nil {
			return nil, err
		}
		if id == last && oddSQL != "" {
			return nil, idem.CompleteExec(ctx, oddSQL, id)
		}
		return nil, nil
	})
	first := 0
	if fast {
		first = 1
	}
	return ids, deliverAllAfter(h, f.msgs(ids), first)
}

// A CompleteExec member whose lease was taken over while it called
// completes in the same batch as live ones: the pipelined completion's
// token check fails, nothing of it commits, and the batch is written
// again member by member: the live ones complete, the stale one writes
// nothing and gets ErrLeaseLost.
func TestCompleteExec_StaleMemberInABatch(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: -1})
	const n = 20
	ids, errs := execBatch(t, f, d, false, n, func(_ context.Context, id uuid.UUID) {
		// Another delivery holds the lease now.
		f.db.Exec(t, "UPDATE processed_event_lease SET token = $2 WHERE event_id = $1", id, uuid.New())
	}, "")
	for i, err := range errs {
		if i == n {
			require.ErrorIs(t, err, idem.ErrLeaseLost)
		} else {
			require.NoError(t, err)
		}
	}
	require.Equal(t, n, f.ledgerRows(t), "the stale member wrote nothing")
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", ids[n]))
	require.Equal(t, n, f.claims(t))
	require.Equal(t, 1, f.leases(t), "the other delivery's lease stands")
	require.EqualValues(t, 1, d.Stats().LeasesLost)
}

// A failing CompleteExec statement in one member: the batch's one
// transaction is rolled back, the members complete one by one, and only
// that one fails, with PostgreSQL's error (SQLSTATE) wrapped.
func TestCompleteExec_FailingStatementInABatch(t *testing.T) {
	t.Parallel()
	for _, fast := range []bool{false, true} {
		t.Run(map[bool]string{false: "two phases", true: "fast path"}[fast], func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			fp := -time.Duration(1)
			if fast {
				fp = 5 * time.Second
			}
			d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: fp})
			const n = 20
			ids, errs := execBatch(t, f, d, fast, n, nil, "INSERT INTO no_such_ledger (event_id) VALUES ($1)")
			for i, err := range errs {
				if i == n {
					var pgErr *pgconn.PgError
					require.True(t, errors.As(err, &pgErr), "%v", err)
					require.Equal(t, pgerrcode.UndefinedTable, pgErr.Code)
				} else {
					require.NoError(t, err)
				}
			}
			require.Equal(t, n, f.ledgerRows(t))
			require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", ids[n]), "its first statement rolled back too")
			require.Equal(t, n, f.claims(t))
			require.Zero(t, f.leases(t), "the failed one's lease was released")
			st := d.Stats()
			require.EqualValues(t, 1, st.GroupFallbacks)
			if fast {
				require.EqualValues(t, n, st.LeasesFastPath)
			}
		})
	}
}

// On the fast path a transaction-mode delivery claims one member's event
// while its handler runs: the pipelined claim finds it, nothing of the
// batch commits, and the batch is written again: the others complete, that
// one is a duplicate and writes nothing.
func TestCompleteExec_FastPathClaimedMeanwhile(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: 5 * time.Second})
	txMode := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	const n = 20
	ids, errs := execBatch(t, f, d, true, n, func(_ context.Context, id uuid.UUID) {
		_, err := txMode.Middleware(f.insertHandler(1, &calls))(f.msg(id))
		require.NoError(t, err)
	}, "")
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, n+1, f.ledgerRows(t))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1 AND amount = 1", ids[n]), "transaction mode's write only")
	require.Equal(t, n, f.db.Count(t, "SELECT 1 FROM ledger WHERE amount = 2"))
	st := d.Stats()
	require.EqualValues(t, 1, st.Duplicates)
	require.EqualValues(t, n, st.LeasesFastPath)
}

// The live batch: every member completes in the pipelined transaction,
// in both paths, and CompleteExec runs at once in transaction mode.
func TestCompleteExec_Batch(t *testing.T) {
	t.Parallel()
	for _, fast := range []bool{false, true} {
		t.Run(map[bool]string{false: "two phases", true: "fast path"}[fast], func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			fp := -time.Duration(1)
			if fast {
				fp = 5 * time.Second
			}
			d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: fp})
			const n = 20
			_, errs := execBatch(t, f, d, fast, n, nil, "UPDATE ledger SET amount = amount + 1 WHERE event_id = $1")
			for _, err := range errs {
				require.NoError(t, err)
			}
			require.Equal(t, n+1, f.ledgerRows(t))
			require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE amount = 3"), "the odd one's second statement ran after its first")
			require.Equal(t, n+1, f.claims(t))
			require.Zero(t, f.leases(t))
			require.Zero(t, d.Stats().GroupFallbacks)
		})
	}
	t.Run("transaction mode", func(t *testing.T) {
		t.Parallel()
		f := newLedgerFixture(t)
		d := f.dedup(t, "billing", nil)
		h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
			id, _ := idem.EventIDFromContext(m.Context())
			return nil, idem.CompleteExec(m.Context(), ledgerExec, id)
		})
		_, err := h(f.msg(publisher.NewEventID()))
		require.NoError(t, err)
		require.Equal(t, 1, f.ledgerRows(t))
		require.ErrorIs(t, idem.CompleteExec(context.Background(), ledgerExec, uuid.New()), idem.ErrNotInHandler)
	})
}

// A pipelined completion paused between its token check and its commit
// (its second statement waits for a table lock the test holds): another
// delivery of the event, taking over or not, waits for the check's lock
// on the lease row, then finds the event done; one write.
func TestCompleteExec_DeliveryDuringThePipelinedCompletion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	f.db.Exec(t, "CREATE TABLE gate (event_id uuid)")
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: -1})
	other := f.leaseDedup(t, idem.LeaseConfig{BusyWait: time.Hour, FastPath: -1})
	var calls atomic.Int32
	h := func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		id, _ := idem.EventIDFromContext(m.Context())
		if err := idem.CompleteExec(m.Context(), ledgerExec, id); err != nil {
			return nil, err
		}
		return nil, idem.CompleteExec(m.Context(), "INSERT INTO gate (event_id) VALUES ($1)", id)
	}
	// Both middlewares start, and prepare the statements, before the gate closes.
	_, err := other.Middleware(h)(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	_, err = d.Middleware(h)(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	lockTx, err := f.db.Pool.Begin(ctx) // not the middleware's pool: it needs its connections
	require.NoError(t, err)
	defer func() { _ = lockTx.Rollback(ctx) }()
	_, err = lockTx.Exec(ctx, "LOCK TABLE gate IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	id := publisher.NewEventID()
	done := deliverAsync(d.Middleware(h), f.msg(id))
	require.Eventually(t, func() bool {
		return f.db.Count(t, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO gate%'") == 1
	}, 30*time.Second, 10*time.Millisecond, "the completion waits for the gate, its check done")
	otherDone := deliverAsync(other.Middleware(h), f.msg(id))
	require.Eventually(t, func() bool {
		return f.db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO "' || $1 || '"."%_lease"%'`, f.db.Schema) == 1
	}, 30*time.Second, 10*time.Millisecond, "the second delivery's take waits for the completion's lock")
	require.NoError(t, lockTx.Rollback(ctx))
	require.NoError(t, <-done)
	require.NoError(t, <-otherDone)
	require.EqualValues(t, 3, calls.Load())
	require.EqualValues(t, 1, other.Stats().Duplicates)
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", id))
	require.Equal(t, 3, f.ledgerRows(t))
	require.Zero(t, f.leases(t))
}
