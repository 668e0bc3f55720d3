package middleware_test

// The consumer-side failure scenarios of DESIGN.md §1, driven through
// Dedup.Middleware against a real PostgreSQL schema.

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Crash after COMMIT, before the offset commit: the claim and the business
// row are committed, the broker redelivers (a new message, same event id),
// and the redelivery is acked without running the handler.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(100, &calls))

	id := publisher.NewEventID()
	_, err := h(f.msg(id))
	require.NoError(t, err)
	// The process dies here: the router never acks, Sarama never marks the
	// offset, and after the restart the same record is delivered again.
	for range 3 {
		out, err := h(f.msg(id))
		require.NoError(t, err, "a redelivered duplicate is acked")
		require.Empty(t, out)
	}

	require.EqualValues(t, 1, calls.Load(), "handler ran once")
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.claims(t))
}

// Handler error: ROLLBACK (neither the claim nor the business row survive),
// the error propagates (nack), and the redelivery processes the event once.
func TestHandlerErrorRollsBackThenRedeliveryProcessesOnce(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	boom := errors.New("downstream unavailable")
	var failing, ok atomic.Int32

	id := publisher.NewEventID()
	_, err := d.Middleware(f.failingHandler(100, &failing, boom))(f.msg(id))
	require.ErrorIs(t, err, boom)
	require.False(t, idem.IsPermanent(err), "a handler error is retried, not poisoned")
	require.Equal(t, 0, f.claims(t), "no claim row after rollback")
	require.Equal(t, 0, f.ledgerRows(t), "no business row after rollback")
	require.Zero(t, f.pool.Stat().AcquiredConns(), "the connection went back to the pool")

	h := d.Middleware(f.insertHandler(100, &ok))
	_, err = h(f.msg(id)) // redelivery
	require.NoError(t, err)
	_, err = h(f.msg(id)) // and once more: now a duplicate
	require.NoError(t, err)

	require.EqualValues(t, 1, failing.Load())
	require.EqualValues(t, 1, ok.Load())
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.claims(t))
}

// Handler panic: ROLLBACK, the panic propagates unchanged; under watermill's
// Recoverer it becomes an error (nack); the redelivery processes once.
func TestHandlerPanicRollsBackThenRedeliveryProcessesOnce(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	var panicking, ok atomic.Int32
	panicky := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		_, _ = f.insertHandler(100, &panicking)(m)
		panic("handler bug")
	})

	id := publisher.NewEventID()
	m := f.msg(id)
	origCtx := m.Context()
	require.PanicsWithValue(t, "handler bug", func() { _, _ = panicky(m) })
	require.Equal(t, origCtx, m.Context(), "context restored after a panic")
	require.Equal(t, 0, f.claims(t))
	require.Equal(t, 0, f.ledgerRows(t))
	require.Zero(t, f.pool.Stat().AcquiredConns(), "the connection went back to the pool")

	_, err := wmiddleware.Recoverer(panicky)(f.msg(id))
	var rp wmiddleware.RecoveredPanicError
	require.ErrorAs(t, err, &rp)
	require.Equal(t, "handler bug", rp.V)
	require.False(t, idem.IsPermanent(err))
	require.Equal(t, 0, f.claims(t))

	_, err = wmiddleware.Recoverer(d.Middleware(f.insertHandler(100, &ok)))(f.msg(id))
	require.NoError(t, err)
	require.EqualValues(t, 2, panicking.Load())
	require.EqualValues(t, 1, ok.Load())
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.claims(t))
}

// Retry outside the middleware: every attempt gets a fresh transaction, so a
// failed attempt leaves nothing behind and the successful one commits once.
func TestRetryOutsideGivesEachAttemptAFreshTransaction(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	var txs []pgx.Tx
	h := wmiddleware.Retry{MaxRetries: 3}.Middleware(d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		txs = append(txs, idem.MustTxFromContext(m.Context()))
		if _, err := f.insertHandler(7, &calls)(m); err != nil {
			return nil, err
		}
		if calls.Load() < 3 {
			return nil, errors.New("transient")
		}
		return nil, nil
	}))

	_, err := h(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	require.EqualValues(t, 3, calls.Load())
	require.Len(t, txs, 3)
	require.NotSame(t, txs[0], txs[1])
	require.NotSame(t, txs[1], txs[2])
	require.Equal(t, 1, f.ledgerRows(t), "only the successful attempt's write committed")
	require.Equal(t, 1, f.claims(t))
}

// concurrentClaim runs a first delivery of id whose handler holds its
// transaction open, then a second delivery of the same id, and returns once
// the second is provably waiting on the first's claim.
type concurrentClaim struct {
	firstErr     chan error
	secondErr    chan error
	release      chan error // the first handler returns what is sent here
	firstCalls   atomic.Int32
	secondCalls  atomic.Int32
	firstBackend int32
	id           uuid.UUID
}

func startConcurrentClaim(t *testing.T, f *ledgerFixture, d *idem.Dedup) *concurrentClaim {
	t.Helper()
	ctx := context.Background()
	c := &concurrentClaim{
		firstErr:  make(chan error, 1),
		secondErr: make(chan error, 1),
		release:   make(chan error),
	}
	id := publisher.NewEventID()
	c.id = id
	pid := make(chan int32, 1)
	first := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if _, err := f.insertHandler(1, &c.firstCalls)(m); err != nil {
			return nil, err
		}
		pid <- ledgerBackendPID(ctx, idem.MustTxFromContext(m.Context()))
		return nil, <-c.release
	})
	go func() {
		_, err := first(f.msg(id))
		c.firstErr <- err
	}()
	c.firstBackend = <-pid // the first claim is inserted and uncommitted
	require.Positive(t, c.firstBackend)
	// Should the test fail while the first handler waits, let it return, so
	// the pool can close.
	t.Cleanup(func() {
		select {
		case c.release <- errors.New("test ended"):
		default:
		}
	})

	second := d.Middleware(f.insertHandler(2, &c.secondCalls))
	go func() {
		_, err := second(f.msg(id))
		c.secondErr <- err
	}()

	// The second claim's INSERT waits on the unique index entry of the first,
	// uncommitted one: its backend is blocked by the first's backend.
	require.Eventually(t, func() bool { return f.blockedBy(t, c.firstBackend) == 1 }, 30*time.Second, 10*time.Millisecond,
		"the second claim should wait on a lock held by the first transaction")
	select {
	case err := <-c.secondErr:
		t.Fatalf("the second delivery returned (%v) while the first transaction is still open", err)
	default:
	}
	require.Zero(t, c.secondCalls.Load())
	return c
}

// Two consumers get the same event at once; the first commits: the second
// waits, then skips.
func TestConcurrentClaimWaitsThenSkipsWhenFirstCommits(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	c := startConcurrentClaim(t, f, f.dedup(t, "billing", nil))

	c.release <- nil // the first handler succeeds; the middleware commits
	require.NoError(t, <-c.firstErr)
	require.NoError(t, <-c.secondErr, "the duplicate is acked")
	require.EqualValues(t, 1, c.firstCalls.Load())
	require.Zero(t, c.secondCalls.Load(), "the second handler never ran")
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE amount = 1"))
	require.Equal(t, 1, f.claims(t))
}

// Two consumers get the same event at once; the first rolls back: the
// second waits, then processes it.
func TestConcurrentClaimWaitsThenProcessesWhenFirstRollsBack(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	c := startConcurrentClaim(t, f, f.dedup(t, "billing", nil))

	boom := errors.New("first attempt failed")
	c.release <- boom
	require.ErrorIs(t, <-c.firstErr, boom)
	require.NoError(t, <-c.secondErr)
	require.EqualValues(t, 1, c.firstCalls.Load())
	require.EqualValues(t, 1, c.secondCalls.Load(), "the second delivery processed the event")
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE amount = 2"), "only the second handler's write survived")
	require.Equal(t, 1, f.claims(t))
}

// Under REPEATABLE READ the waiting claim fails with SQLSTATE 40001 when the
// first commits. The middleware returns it as an ordinary (retryable) error,
// never as "processed", and the retry then sees a duplicate.
func TestRepeatableReadConcurrentDuplicateIsRetryableSerializationFailure(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TxOptions = pgx.TxOptions{IsoLevel: pgx.RepeatableRead} })
	c := startConcurrentClaim(t, f, d)

	c.release <- nil
	require.NoError(t, <-c.firstErr)
	err := <-c.secondErr
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.SerializationFailure, pgErr.Code)
	require.False(t, idem.IsPermanent(err), "a serialization failure must be retried, not poisoned")
	require.Zero(t, c.secondCalls.Load())
	require.Zero(t, f.pool.Stat().AcquiredConns(), "the failed transaction was rolled back")

	// The retry (a fresh transaction, a fresh snapshot) sees the committed claim.
	var retryCalls atomic.Int32
	_, err = d.Middleware(f.insertHandler(3, &retryCalls))(f.msg(c.id))
	require.NoError(t, err)
	require.Zero(t, retryCalls.Load(), "the retry is a duplicate")
	require.Equal(t, 1, f.ledgerRows(t))
	require.Equal(t, 1, f.claims(t))
}

// The same event id consumed by two consumer groups: each group applies it
// once.
func TestTwoConsumerGroupsEachProcessOnce(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var billingCalls, shippingCalls atomic.Int32
	billing := f.dedup(t, "billing", nil).Middleware(f.insertHandler(10, &billingCalls))
	shipping := f.dedup(t, "shipping", nil).Middleware(f.insertHandler(20, &shippingCalls))

	id := publisher.NewEventID()
	for range 2 {
		_, err := billing(f.msg(id))
		require.NoError(t, err)
		_, err = shipping(f.msg(id))
		require.NoError(t, err)
	}

	require.EqualValues(t, 1, billingCalls.Load())
	require.EqualValues(t, 1, shippingCalls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE consumer_group = 'billing' AND amount = 10"))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE consumer_group = 'shipping' AND amount = 20"))
	require.Equal(t, 2, f.claims(t))
	require.Equal(t, 2, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id))
}

// A duplicate is acked without running the handler and its transaction ends
// with ROLLBACK, not COMMIT (nothing to flush); the claim row is untouched.
func TestDuplicateEndsWithRollbackAndLeavesClaimUnchanged(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(5, &calls))
	id := publisher.NewEventID()

	f.sql.reset()
	_, err := h(f.msg(id))
	require.NoError(t, err)
	require.Equal(t, 1, f.sql.count("commit"), "the first delivery commits")
	require.Zero(t, f.sql.count("rollback"))

	type claimRow struct {
		Xmin        string
		ProcessedAt time.Time
	}
	readClaim := func() claimRow {
		var r claimRow
		require.NoError(t, f.db.Pool.QueryRow(context.Background(),
			"SELECT xmin::text, processed_at FROM processed_event WHERE event_id = $1", id).Scan(&r.Xmin, &r.ProcessedAt))
		return r
	}
	before := readClaim()

	f.sql.reset()
	_, err = h(f.msg(id))
	require.NoError(t, err)
	require.Equal(t, 1, f.sql.count("rollback"), "the duplicate's transaction is rolled back")
	require.Zero(t, f.sql.count("commit"), "the duplicate's transaction is never committed")
	require.EqualValues(t, 1, calls.Load(), "handler not called for the duplicate")
	require.Equal(t, before, readClaim(), "the claim row is unchanged")
	require.Equal(t, 1, f.claims(t))
	require.Equal(t, 1, f.ledgerRows(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

type restoreCtxKey struct{}

// The handler sees the transaction, event id and consumer group in
// msg.Context(); whatever the outcome, the message's original context is
// back when the middleware returns.
func TestOriginalContextRestored(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	id := publisher.NewEventID()
	boom := errors.New("boom")

	for _, tc := range []struct {
		name string
		want error
	}{{"error", boom}, {"success", nil}, {"duplicate", nil}} {
		m := f.msg(id)
		orig := context.WithValue(context.Background(), restoreCtxKey{}, "caller value")
		m.SetContext(orig)
		_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
			ctx := m.Context()
			require.Equal(t, "caller value", ctx.Value(restoreCtxKey{}), "the handler's context derives from the message's")
			_, ok := idem.TxFromContext(ctx)
			require.True(t, ok)
			gotID, ok := idem.EventIDFromContext(ctx)
			require.True(t, ok)
			require.Equal(t, id, gotID)
			group, ok := idem.ConsumerGroupFromContext(ctx)
			require.True(t, ok)
			require.Equal(t, "billing", group)
			return nil, tc.want
		})(m)
		require.ErrorIs(t, err, tc.want, tc.name)
		require.Equal(t, orig, m.Context(), "%s: original context restored", tc.name)
		_, ok := idem.TxFromContext(m.Context())
		require.False(t, ok, "%s: no transaction left in the message's context", tc.name)
	}
	require.Equal(t, 1, f.claims(t))
}

// A COMMIT that fails (here a deferred constraint) is returned as an error
// (nack): neither the claim nor the business row exist, and the handler's
// returned messages are not handed to the router.
func TestCommitFailureIsReturnedAndLeavesNothing(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	f.db.Exec(t, "CREATE TABLE once (k int, CONSTRAINT once_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
	d := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	out, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if _, err := f.insertHandler(1, &calls)(m); err != nil {
			return nil, err
		}
		_, err := idem.MustTxFromContext(m.Context()).Exec(m.Context(), "INSERT INTO once VALUES (1), (1)") // checked at COMMIT
		return []*message.Message{message.NewMessage(uuid.NewString(), nil)}, err
	})(f.msg(publisher.NewEventID()))
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.UniqueViolation, pgErr.Code)
	require.False(t, idem.IsPermanent(err))
	require.Empty(t, out)
	require.EqualValues(t, 1, calls.Load())
	require.Zero(t, f.claims(t))
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// Messages a handler returns (no outbox configured) reach the router after
// COMMIT on the first delivery, and never for a duplicate.
func TestReturnedMessagesOnlyForFirstDelivery(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte("next"))}, nil
	})
	id := publisher.NewEventID()
	out, err := h(f.msg(id))
	require.NoError(t, err)
	require.Len(t, out, 1)
	out, err = h(f.msg(id))
	require.NoError(t, err)
	require.Empty(t, out)
}

// Shutdown while a claim waits on another consumer's transaction: the
// waiting delivery returns promptly with the context's error (nack) and
// leaves nothing; the first is unaffected.
func TestWaitingClaimReturnsOnContextCancel(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	ctx := context.Background()
	id := publisher.NewEventID()
	release := make(chan struct{})
	pid := make(chan int32, 1)
	firstErr := make(chan error, 1)
	var firstCalls, secondCalls atomic.Int32
	go func() {
		_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
			if _, err := f.insertHandler(1, &firstCalls)(m); err != nil {
				return nil, err
			}
			pid <- ledgerBackendPID(ctx, idem.MustTxFromContext(m.Context()))
			<-release
			return nil, nil
		})(f.msg(id))
		firstErr <- err
	}()
	firstPID := <-pid
	require.Positive(t, firstPID)
	var once sync.Once
	releaseFirst := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseFirst) // let the first handler return even if the test fails

	secondCtx, cancel := context.WithCancel(ctx)
	second := f.msg(id)
	second.SetContext(secondCtx)
	secondErr := make(chan error, 1)
	go func() {
		_, err := d.Middleware(f.insertHandler(2, &secondCalls))(second)
		secondErr <- err
	}()
	require.Eventually(t, func() bool { return f.blockedBy(t, firstPID) == 1 }, 30*time.Second, 10*time.Millisecond)
	cancel() // the router is closing
	err := <-secondErr
	require.Error(t, err)
	require.False(t, idem.IsPermanent(err))
	require.Zero(t, secondCalls.Load())
	require.Equal(t, secondCtx, second.Context())

	releaseFirst()
	require.NoError(t, <-firstErr)
	require.Equal(t, 1, f.claims(t))
	require.Equal(t, 1, f.ledgerRows(t))
	require.Eventually(t, func() bool { return f.pool.Stat().AcquiredConns() == 0 }, 30*time.Second, 10*time.Millisecond)
}
