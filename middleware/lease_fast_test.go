package middleware_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/leasetest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// countLeaseInserts makes the fixture's lease table count every row ever
// inserted into it: the fast path's claim is that a quick handler writes
// none, not that none is left.
func (f *ledgerFixture) countLeaseInserts(t *testing.T) func() int {
	t.Helper()
	f.db.Exec(t, "CREATE TABLE lease_inserts (event_id uuid)")
	f.db.Exec(t, `CREATE FUNCTION count_lease_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO lease_inserts VALUES (NEW.event_id); RETURN NEW; END $$`)
	f.db.Exec(t, "CREATE TRIGGER count_lease_insert AFTER INSERT ON processed_event_lease FOR EACH ROW EXECUTE FUNCTION count_lease_insert()")
	return func() int { return f.db.Count(t, "SELECT 1 FROM lease_inserts") }
}

// idleInTx counts the fixture's sessions idle in transaction (their last
// statement named its schema).
func (f *ledgerFixture) idleInTx(t *testing.T) int {
	return f.db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE '%"' || $1 || '".%'`, f.db.Schema)
}

// A handler still running at FastPath gets its lease row then, committed;
// its session is no longer idle in transaction; another delivery finds the
// live lease; the handler completes as a leased delivery.
func TestFastPath_SlowHandlerGetsALeaseRowAtTheDeadline(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	inserts := f.countLeaseInserts(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 30 * time.Millisecond})
	leased := make(chan struct{})
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "leased" {
			close(leased)
		}
	})
	other := f.leaseDedup(t, idem.LeaseConfig{BusyWait: -1})
	provider := newKeyServer(t)
	var calls atomic.Int32
	g := newGate()
	id := publisher.NewEventID()
	done := deliverAsync(d.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() })), f.msg(id))
	<-g.reached
	<-leased
	require.Equal(t, 1, f.leases(t), "the running handler has its lease row")
	require.Zero(t, f.idleInTx(t), "no session stays idle in transaction")
	_, err := other.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
	require.ErrorIs(t, err, idem.ErrLeaseBusy)

	close(g.release)
	require.NoError(t, <-done)
	require.Equal(t, 1, f.ledgerRows(t))
	require.Zero(t, f.leases(t))
	require.Equal(t, 1, inserts())
	st := d.Stats()
	require.EqualValues(t, 1, st.Processed)
	require.Zero(t, st.LeasesFastPath)
}

// While a fast-path transaction holds an event (its handler in its call),
// another delivery's take finds its advisory lock taken, whichever path
// that delivery takes: it polls as for a live lease, and then finds the
// event done. The handler runs once.
func TestFastPath_AnotherDeliveryWaitsForTheOpenTransaction(t *testing.T) {
	t.Parallel()
	for name, fastPath := range map[string]time.Duration{"taker on the fast path": 0, "taker with lease rows": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 5 * time.Second})
			other := f.leaseDedup(t, idem.LeaseConfig{FastPath: fastPath, BusyWait: time.Hour})
			polled := make(chan struct{}, 1000)
			idem.SetLeaseHook(other, func(point string, _ uuid.UUID) {
				if point == "busy" {
					polled <- struct{}{}
				}
			})
			provider := newKeyServer(t)
			var calls atomic.Int32
			g := newGate()
			id := publisher.NewEventID()
			done := deliverAsync(d.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() })), f.msg(id))
			<-g.reached
			otherDone := deliverAsync(other.Middleware(chargeHandler(t, provider, &calls, nil)), f.msg(id))
			<-polled // found the event held by the fast path's lock, and polls
			<-polled
			select {
			case err := <-otherDone:
				t.Fatalf("the second delivery returned (%v) while the first held the event", err)
			default:
			}
			close(g.release)
			require.NoError(t, <-done)
			require.NoError(t, <-otherDone)
			require.EqualValues(t, 1, calls.Load())
			require.EqualValues(t, 1, other.Stats().Duplicates)
			require.EqualValues(t, 1, d.Stats().LeasesFastPath)
			require.Equal(t, 1, f.ledgerRows(t))
		})
	}
}

// A crashed owner's expired lease is taken over on the fast path: the
// completion deletes it with the claim, and the old owner's token then
// completes nothing.
func TestFastPath_ExpiredLeaseIsTakenOverInline(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 5 * time.Second})
	p := leasesql.New(f.db.Schema, "processed_event", "billing")
	id := publisher.NewEventID()
	crashed := leasetest.Req(id)
	leasetest.Take(t, f.db, p, time.Hour, crashed)
	f.db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'")
	provider := newKeyServer(t)
	var calls atomic.Int32
	_, err := d.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
	require.NoError(t, err)
	st := d.Stats()
	require.EqualValues(t, 1, st.LeasesTakenOver)
	require.EqualValues(t, 1, st.LeasesFastPath)
	require.Equal(t, 1, f.ledgerRows(t))
	require.Zero(t, f.leases(t), "the expired lease left with the claim")
	require.Equal(t, []leasesql.Result{leasesql.Lost}, leasetest.Complete(t, f.db, p, crashed))
}

// A transaction-mode delivery claims the event while a fast-path handler
// runs (it takes no advisory lock): the fast path's claim then finds it,
// writes nothing and acks the message as a duplicate.
func TestFastPath_TransactionModeClaimMeanwhile(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 5 * time.Second})
	txMode := f.dedup(t, "billing", nil)
	provider := newKeyServer(t)
	var calls atomic.Int32
	g := newGate()
	id := publisher.NewEventID()
	done := deliverAsync(d.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() })), f.msg(id))
	<-g.reached
	_, err := txMode.Middleware(f.insertHandler(1, &calls))(f.msg(id))
	require.NoError(t, err)
	close(g.release)
	require.NoError(t, <-done)
	require.EqualValues(t, 1, d.Stats().Duplicates)
	require.Zero(t, d.Stats().LeasesFastPath)
	require.Equal(t, 1, f.ledgerRows(t), "the transaction-mode write only")
}

// Handlers that take together complete together; one whose write fails
// does not take the others down: the batch is written again without it.
// The opener holds the only take slot until every other take is queued,
// so those make one batch.
func TestFastPath_FailingWriteInABatch(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	inserts := f.countLeaseInserts(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: 5 * time.Second})
	const n = 40
	ids := append(newIDs(n), publisher.NewEventID())
	opener, bad := ids[0], ids[n]
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		id, _ := idem.EventIDFromContext(m.Context())
		if id == opener {
			for idem.LeaseTakesQueued(d) < n {
				time.Sleep(time.Millisecond)
			}
		}
		return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			if id == bad {
				return fmt.Errorf("ledger refused %s", id)
			}
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
			return err
		})
	})
	errs := deliverAllAfter(h, f.msgs(ids), 1)
	for i, err := range errs {
		if ids[i] == bad {
			require.ErrorContains(t, err, "ledger refused")
		} else {
			require.NoError(t, err)
		}
	}
	require.Equal(t, n, f.ledgerRows(t))
	require.Equal(t, n, f.claims(t))
	require.Zero(t, inserts(), "all on the fast path")
	st := d.Stats()
	require.EqualValues(t, n, st.LeasesFastPath)
	require.EqualValues(t, 1, st.GroupFallbacks, "the batch of the other 40 was written again once")
}

// deliverAllAfter delivers msgs[:first] and, once they are in, the rest,
// all at once otherwise (see deliverAll).
func deliverAllAfter(h message.HandlerFunc, msgs []*message.Message, first int) []error {
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	for i, m := range msgs {
		wg.Go(func() { _, errs[i] = h(m) })
		if i == first-1 {
			time.Sleep(50 * time.Millisecond) // the opener's take leads its batch
		}
	}
	wg.Wait()
	return errs
}

// The fast path's transaction dies while its handler runs (its session
// terminated: a server restart, a network cut): at the deadline the lease
// row cannot be written, so the handler's context is cancelled with
// ErrLeaseLost and nothing is written.
func TestFastPath_LostTransactionCancelsTheHandler(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 2 * time.Second})
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "taken" {
			require.Equal(t, 1, f.db.Count(t, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE state = 'idle in transaction' AND query LIKE '%"' || $1 || '".%'`, f.db.Schema))
		}
	})
	id := publisher.NewEventID()
	var cause error
	_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		<-m.Context().Done()
		cause = context.Cause(m.Context())
		return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
			return err
		})
	})(f.msg(id))
	require.ErrorIs(t, err, idem.ErrLeaseLost)
	require.ErrorIs(t, cause, idem.ErrLeaseLost)
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.claims(t))
	require.Zero(t, f.leases(t))
}

// A handler that starts after its batch's deadline (the batch wrote its
// lease row before the handler began) still has its lease renewed.
func TestFastPath_LateHandlerIsRenewed(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: time.Millisecond, Duration: time.Minute, RenewInterval: 20 * time.Millisecond})
	leased, renewed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		switch point {
		case "taken":
			<-leased // the deadline passes and the lease row commits first
		case "leased":
			close(leased)
		case "renewed":
			once.Do(func() { close(renewed) })
		}
	})
	provider := newKeyServer(t)
	var calls atomic.Int32
	_, err := d.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { <-renewed }))(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	require.Equal(t, 1, f.ledgerRows(t))
	require.GreaterOrEqual(t, d.Stats().LeasesRenewed, uint64(1))
}

// A handler that panics on the fast path leaves nothing behind: its batch
// neither waits for it nor gives it a lease row, and the redelivery runs
// at once.
func TestFastPath_HandlerPanicLeavesNothing(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	inserts := f.countLeaseInserts(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 5 * time.Second, BusyWait: -1})
	var calls atomic.Int32
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 1 {
			panic("handler bug")
		}
		return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
			return err
		})
	})
	id := publisher.NewEventID()
	require.Panics(t, func() { _, _ = h(f.msg(id)) })
	require.Zero(t, inserts(), "the batch finished without waiting for its deadline (which would lease it)")
	require.Zero(t, f.leases(t))
	require.Zero(t, f.claims(t))
	_, err := h(f.msg(id))
	require.NoError(t, err)
	require.Equal(t, 1, f.ledgerRows(t))
}

// deliverAsync delivers m to h in a goroutine of its own; the delivery's
// error comes on the channel.
func deliverAsync(h message.HandlerFunc, m *message.Message) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := h(m)
		done <- err
	}()
	return done
}

// Handlers that keep running past FastPath turn the fast path off (their
// takes write lease rows at once, no transaction held open for nothing,
// and no probe holds one open either); the calls of those takes are timed,
// so handlers that are quick again turn it back on. Deliveries one at a
// time: each take is a batch of one.
func TestFastPath_SlowHandlersTurnItOffQuickOnesBackOn(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	inserts := f.countLeaseInserts(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 3 * time.Second, Duration: time.Minute})
	leased := make(chan uuid.UUID, 100)
	idem.SetLeaseHook(d, func(point string, id uuid.UUID) {
		if point == "leased" {
			leased <- id
		}
	})
	slow := true
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if slow {
			<-leased // still running at its batch's deadline
		}
		return nil, nil
	})
	for range 4 {
		_, err := h(f.msg(publisher.NewEventID()))
		require.NoError(t, err)
	}
	require.Less(t, idem.LeaseFastShare(d), 0.5, "four batches leased at their deadline")
	require.Equal(t, 4, inserts())

	before := inserts()
	slow = false
	for range 17 {
		_, err := h(f.msg(publisher.NewEventID()))
		require.NoError(t, err)
	}
	require.Equal(t, before+1, inserts(), "one take wrote a lease row; its quick call turned the fast path back on")
	require.EqualValues(t, 16, d.Stats().LeasesFastPath, "the takes after it")
	require.GreaterOrEqual(t, idem.LeaseFastShare(d), 0.5)
}

// While the gate is off, slow handlers keep it off without any take trying
// the fast path: no transaction is held open across a slow call to find
// out (the longest idle in transaction of the lease benchmark came from
// such probes). Handlers sleep past FastPath, so each lease-row call is
// timed slow whatever the machine's speed.
func TestFastPath_NoProbeWhileHandlersAreSlow(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	inserts := f.countLeaseInserts(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: 50 * time.Millisecond, Duration: time.Minute})
	leased := make(chan uuid.UUID, 100)
	idem.SetLeaseHook(d, func(point string, id uuid.UUID) {
		if point == "leased" {
			leased <- id
		}
	})
	first := 4
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if first > 0 {
			first--
			<-leased // a fast batch's member, still running at its deadline
			return nil, nil
		}
		time.Sleep(60 * time.Millisecond) // past FastPath
		return nil, nil
	})
	for range 4 + 20 {
		_, err := h(f.msg(publisher.NewEventID()))
		require.NoError(t, err)
	}
	require.Less(t, idem.LeaseFastShare(d), 0.5)
	require.Equal(t, 24, inserts(), "every take wrote a lease row: the 4 fast batches at their deadline, the 20 after at once")
	require.Zero(t, d.Stats().LeasesFastPath)
	require.Zero(t, len(leased), "a take tried the fast path while handlers were slow (its member leased at the deadline)")
}
