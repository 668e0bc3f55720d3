package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// leaseDedup is a lease-mode middleware on the fixture's pool.
func (f *ledgerFixture) leaseDedup(t *testing.T, lc idem.LeaseConfig) *idem.Dedup {
	t.Helper()
	return f.dedup(t, "billing", func(c *idem.Config) { c.Mode = &lc })
}

// chargeHandler is a lease-mode payment handler: it calls the provider
// with the event's Idempotency-Key (no transaction held), then registers
// its ledger write with Complete. inCall, when set, runs during the call.
func chargeHandler(t *testing.T, provider *keyServer, calls *atomic.Int32, inCall func(ctx context.Context)) message.HandlerFunc {
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(http.DefaultTransport, "charge")}
	return func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		ctx := m.Context()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL, nil)
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		_ = resp.Body.Close()
		if inCall != nil {
			inCall(ctx)
		}
		return nil, idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
			return err
		})
	}
}

// gate pauses a delivery at one point until released.
type gate struct {
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func newGate() *gate { return &gate{reached: make(chan struct{}), release: make(chan struct{})} }

func (g *gate) pass() {
	g.once.Do(func() {
		close(g.reached)
		<-g.release
	})
}

func (f *ledgerFixture) leases(t *testing.T) int {
	t.Helper()
	return f.db.Count(t, "SELECT 1 FROM processed_event_lease")
}

// The handler runs with no transaction and no connection of its own; its
// write commits with the claim; a redelivery is a duplicate that runs
// nothing. With lease rows nothing is held during the call; on the fast
// path (the handler returns within FastPath) its batch holds one
// connection, the take's transaction, and no lease row is ever written (a
// trigger counts the inserts).
func TestLease_HandlerHoldsNoConnection(t *testing.T) {
	t.Parallel()
	for name, fastPath := range map[string]time.Duration{"fast path": 5 * time.Second, "lease row": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			inserts := f.countLeaseInserts(t)
			d := f.leaseDedup(t, idem.LeaseConfig{FastPath: fastPath})
			provider := newKeyServer(t)
			var calls atomic.Int32
			var held int32 = -1
			hasTx := true
			h := d.Middleware(chargeHandler(t, provider, &calls, func(ctx context.Context) {
				held = f.pool.Stat().AcquiredConns()
				_, hasTx = idem.TxFromContext(ctx)
			}))

			id := publisher.NewEventID()
			_, err := h(f.msg(id))
			require.NoError(t, err)
			require.False(t, hasTx, "the handler gets no transaction")
			require.Equal(t, 1, f.ledgerRows(t))
			require.Equal(t, 1, f.claims(t))
			require.Zero(t, f.leases(t), "a completed event keeps no lease")

			_, err = h(f.msg(id))
			require.NoError(t, err)
			require.EqualValues(t, 1, calls.Load(), "the duplicate did not run the handler")
			st := d.Stats()
			require.EqualValues(t, 1, st.Processed)
			require.EqualValues(t, 1, st.Duplicates)
			require.EqualValues(t, 1, st.LeasesTaken)
			if fastPath > 0 {
				require.EqualValues(t, 1, held, "its batch holds one connection, the take's transaction")
				require.Zero(t, inserts(), "no lease row was written")
				require.EqualValues(t, 1, st.LeasesFastPath)
			} else {
				require.Zero(t, held, "no pooled connection is held while the handler calls out")
				require.Equal(t, 1, inserts())
				require.Zero(t, st.LeasesFastPath)
			}
		})
	}
}

// A handler error releases the lease at once (on the fast path it never
// had a row): the redelivery takes a new lease (no takeover, no wait) and
// runs with the same key; the failed attempt wrote nothing.
func TestLease_HandlerErrorReleasesTheLease(t *testing.T) {
	t.Parallel()
	for name, fastPath := range map[string]time.Duration{"fast path": 5 * time.Second, "lease row": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			inserts := f.countLeaseInserts(t)
			d := f.leaseDedup(t, idem.LeaseConfig{BusyWait: -1, FastPath: fastPath})
			provider := newKeyServer(t)
			var calls atomic.Int32
			charge := chargeHandler(t, provider, &calls, nil)
			boom := errors.New("provider said 503")
			h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
				if _, err := charge(m); err != nil {
					return nil, err
				}
				if calls.Load() == 1 {
					return nil, boom
				}
				return nil, nil
			})
			id := publisher.NewEventID()
			_, err := h(f.msg(id))
			require.ErrorIs(t, err, boom)
			require.Zero(t, f.leases(t), "released at once")
			require.Zero(t, f.claims(t))
			require.Zero(t, f.ledgerRows(t), "the registered write was not run")

			_, err = h(f.msg(id))
			require.NoError(t, err)
			require.Equal(t, 1, f.ledgerRows(t))
			keys := provider.Keys()
			require.Len(t, keys, 2)
			require.Equal(t, keys[0], keys[1], "both attempts called with the same Idempotency-Key")
			require.Zero(t, d.Stats().LeasesTakenOver)
			if fastPath > 0 {
				require.Zero(t, inserts(), "no lease row on the fast path")
			} else {
				require.Equal(t, 2, inserts(), "one lease row per attempt")
			}
		})
	}
}

// A live lease of another delivery: the second delivery does not run the
// handler. With no BusyWait it returns ErrLeaseBusy at once; with one, it
// waits and finds the event done when the first completes.
func TestLease_LiveLeaseOfAnotherDelivery(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	first := f.leaseDedup(t, idem.LeaseConfig{})
	impatient := f.leaseDedup(t, idem.LeaseConfig{BusyWait: -1})
	patient := f.leaseDedup(t, idem.LeaseConfig{BusyWait: time.Hour})
	provider := newKeyServer(t)
	var calls atomic.Int32
	g := newGate()
	id := publisher.NewEventID()
	firstDone := make(chan error, 1)
	go func() {
		_, err := first.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() }))(f.msg(id))
		firstDone <- err
	}()
	<-g.reached // the first delivery is in its call, holding the lease

	_, err := impatient.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
	require.ErrorIs(t, err, idem.ErrLeaseBusy)
	require.False(t, idem.IsPermanent(err), "retried, not poisoned")
	require.EqualValues(t, 1, impatient.Stats().LeasesBusy)

	patientDone := make(chan error, 1)
	go func() {
		_, err := patient.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
		patientDone <- err
	}()
	close(g.release)
	require.NoError(t, <-firstDone)
	require.NoError(t, <-patientDone, "it waited, then found the event done")
	require.EqualValues(t, 1, calls.Load(), "one handler ran the event")
	require.EqualValues(t, 1, patient.Stats().Duplicates)
	require.Equal(t, 1, f.ledgerRows(t))
}

// The lease expires while its first owner is still calling (its renewals
// did not get through): a second delivery takes it over and completes; the
// first then writes nothing and gets ErrLeaseLost. The provider saw one key.
func TestLease_TakenOverWhileTheFirstOwnerCalls(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	slow := f.leaseDedup(t, idem.LeaseConfig{Duration: time.Hour, RenewInterval: 59 * time.Minute, FastPath: -1})
	other := f.leaseDedup(t, idem.LeaseConfig{})
	provider := newKeyServer(t)
	var calls atomic.Int32
	g := newGate()
	id := publisher.NewEventID()
	slowDone := make(chan error, 1)
	go func() {
		_, err := slow.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() }))(f.msg(id))
		slowDone <- err
	}()
	<-g.reached
	f.db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'") // its renewals did not get through

	_, err := other.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
	require.NoError(t, err)
	require.EqualValues(t, 1, other.Stats().LeasesTakenOver)
	require.Equal(t, 1, f.ledgerRows(t))

	close(g.release)
	err = <-slowDone
	require.ErrorIs(t, err, idem.ErrLeaseLost)
	require.False(t, idem.IsPermanent(err))
	require.Equal(t, 1, f.ledgerRows(t), "the first owner wrote nothing")
	require.EqualValues(t, 1, slow.Stats().LeasesLost)
	keys := provider.Keys()
	require.Len(t, keys, 2, "both owners called")
	require.Equal(t, keys[0], keys[1], "with one Idempotency-Key: the provider charges once")
}

// A crashed owner's lease (taken, never completed nor released) expires,
// and the next delivery takes it over.
func TestLease_CrashedOwnerIsTakenOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{BusyWait: -1})
	id := publisher.NewEventID()
	// The crashed process took the lease, then vanished.
	_, err := leasesql.New(f.db.Schema, "processed_event", "billing").Take(ctx, f.pool, []leasesql.Request{{EventID: id, Token: uuid.New()}}, time.Hour, "gone:1")
	require.NoError(t, err)
	provider := newKeyServer(t)
	var calls atomic.Int32
	h := d.Middleware(chargeHandler(t, provider, &calls, nil))

	_, err = h(f.msg(id))
	require.ErrorIs(t, err, idem.ErrLeaseBusy, "live: not taken before it expires")
	require.Zero(t, calls.Load())

	f.db.Exec(t, "UPDATE processed_event_lease SET expires_at = now()")
	_, err = h(f.msg(id))
	require.NoError(t, err)
	require.EqualValues(t, 1, d.Stats().LeasesTakenOver)
	require.Equal(t, 1, f.ledgerRows(t))
}

// Renewal keeps a long call's lease: it is extended past its first expiry,
// and another delivery finds it live.
func TestLease_RenewalKeepsALongCallsLease(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Duration: time.Minute, RenewInterval: 20 * time.Millisecond, FastPath: -1})
	var renewals atomic.Int32
	renewed := make(chan struct{}, 100)
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "renewed" && renewals.Add(1) <= 2 {
			renewed <- struct{}{}
		}
	})
	other := f.leaseDedup(t, idem.LeaseConfig{BusyWait: -1})
	provider := newKeyServer(t)
	var calls atomic.Int32
	id := publisher.NewEventID()
	g := newGate()
	done := make(chan error, 1)
	go func() {
		_, err := d.Middleware(chargeHandler(t, provider, &calls, func(context.Context) { g.pass() }))(f.msg(id))
		done <- err
	}()
	<-g.reached
	<-renewed
	<-renewed
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event_lease WHERE expires_at > taken_at + interval '1 minute'"),
		"renewed: it now expires later than its first expiry")
	_, err := other.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
	require.ErrorIs(t, err, idem.ErrLeaseBusy)
	close(g.release)
	require.NoError(t, <-done)
	require.GreaterOrEqual(t, d.Stats().LeasesRenewed, uint64(2))
	require.Equal(t, 1, f.ledgerRows(t))
}

// A renewal that finds the lease released by an operator cancels the
// handler's context with ErrLeaseLost; nothing is written.
func TestLease_RenewalFindsTheLeaseGone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Duration: time.Minute, RenewInterval: 10 * time.Millisecond, FastPath: -1})
	id := publisher.NewEventID()
	taken := make(chan struct{})
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "taken" {
			close(taken)
		}
	})
	var cause error
	done := make(chan error, 1)
	go func() {
		_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
			<-m.Context().Done() // a call that ends only when its context does
			cause = context.Cause(m.Context())
			return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
				return err
			})
		})(f.msg(id))
		done <- err
	}()
	<-taken
	ok, err := leasesql.ForceRelease(ctx, f.pool, f.db.Schema, "", id, "billing")
	require.NoError(t, err)
	require.True(t, ok)
	err = <-done
	require.ErrorIs(t, err, idem.ErrLeaseLost)
	require.ErrorIs(t, cause, idem.ErrLeaseLost, "the handler's context says why it was cancelled")
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.claims(t))
}

// The completion holds the lease's row lock until COMMIT. A delivery that
// arrives while the first one is paused inside its completing transaction
// waits for it, then finds the event done: the handler runs once.
func TestLease_DeliveryDuringTheCompletion(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{FastPath: -1})
	g := newGate()
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "completing" {
			g.pass()
		}
	})
	other := f.leaseDedup(t, idem.LeaseConfig{BusyWait: time.Hour, FastPath: -1})
	provider := newKeyServer(t)
	var calls atomic.Int32
	id := publisher.NewEventID()
	done := make(chan error, 1)
	go func() {
		_, err := d.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
		done <- err
	}()
	<-g.reached
	otherDone := make(chan error, 1)
	go func() {
		_, err := other.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
		otherDone <- err
	}()
	require.Eventually(t, func() bool {
		return f.db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO "' || $1 || '"."%_lease"%'`, f.db.Schema) == 1
	}, 30*time.Second, 10*time.Millisecond, "the second delivery's take waits for the completion's lock")
	close(g.release)
	require.NoError(t, <-done)
	require.NoError(t, <-otherDone)
	require.EqualValues(t, 1, calls.Load())
	require.EqualValues(t, 1, other.Stats().Duplicates)
	require.Equal(t, 1, f.ledgerRows(t))
	require.Zero(t, f.leases(t))
}

// Deliveries that arrive together share the phases' transactions; one
// whose write fails does not take the others down: the batch falls back to
// one transaction each, and only that one fails (its lease released). The
// first completion is paused inside its transaction (holding the only
// slot) until every other completion, the failing one included, is queued:
// they then make one batch.
func TestLease_BatchesAndAFailingWrite(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{Concurrency: 1, FastPath: -1})
	const n = 40
	ids := append(newIDs(n), publisher.NewEventID())
	opener, bad := ids[0], ids[n]
	firstPaused, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	idem.SetLeaseHook(d, func(point string, _ uuid.UUID) {
		if point == "completing" {
			once.Do(func() {
				close(firstPaused)
				<-release
			})
		}
	})
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		id, _ := idem.EventIDFromContext(m.Context())
		if id != opener {
			<-firstPaused
		}
		return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			if id == bad {
				return fmt.Errorf("ledger refused %s", id)
			}
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id)
			return err
		})
	})
	go func() {
		<-firstPaused
		for idem.LeaseCompletionsQueued(d) < n {
			time.Sleep(time.Millisecond)
		}
		close(release)
	}()
	errs := deliverAll(h, f.msgs(ids))
	for i, err := range errs {
		if ids[i] == bad {
			require.ErrorContains(t, err, "ledger refused")
		} else {
			require.NoError(t, err)
		}
	}
	require.Equal(t, n, f.ledgerRows(t))
	require.Equal(t, n, f.claims(t))
	require.Zero(t, f.leases(t), "the failed one's lease was released")
	require.EqualValues(t, 1, d.Stats().GroupFallbacks, "the batch of the other 40 fell back once")
}

// Complete works in transaction mode too: the write runs at once on the
// message's transaction, so a handler is written once for both modes.
func TestComplete_InTransactionMode(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	provider := newKeyServer(t)
	var calls atomic.Int32
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if _, ok := idem.TxFromContext(m.Context()); !ok {
			return nil, errors.New("transaction mode without a transaction")
		}
		return chargeHandler(t, provider, &calls, nil)(m)
	})
	_, err := h(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	require.Equal(t, 1, f.ledgerRows(t))
	require.ErrorIs(t, idem.Complete(context.Background(), func(context.Context, pgx.Tx) error { return nil }), idem.ErrNotInHandler)
}

func TestLease_ConfigRefusals(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	base := idem.Config{DB: f.pool, ConsumerGroup: "g", Table: deduplicator.TableConfig{Schema: f.db.Schema}}
	for name, c := range map[string]struct {
		mod  func(*idem.Config)
		want string
	}{
		// Lease mode with group commit cannot be written: Config.Mode holds one.
		"renew too slow": {func(c *idem.Config) { lease(c).RenewInterval = time.Minute; lease(c).Duration = time.Minute }, "must be shorter than Mode.Duration"},
		"no pool":        {func(c *idem.Config) { c.DB = fakeTxBeginner{} }, "needs a *pgxpool.Pool"},
		"pool too small": {func(c *idem.Config) { c.Concurrency = 1000; lease(c).Concurrency = 10 }, "lease mode runs up to 21 transactions"},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := base
			cfg.Mode = &idem.LeaseConfig{}
			c.mod(&cfg)
			require.ErrorContains(t, cfg.Validate(), c.want)
		})
	}
	cfg := base
	cfg.Mode = &idem.LeaseConfig{Concurrency: 3}
	cfg.Concurrency = 5000 // handlers hold no connection: MaxInFlight in the thousands on a small pool
	require.NoError(t, cfg.Validate())
}

type fakeTxBeginner struct{}

func (fakeTxBeginner) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("no") }

// Lease mode's phases are spans of their own under the message's consumer
// span; the outcome of a lost lease is recorded on it.
func TestLease_SpanPerPhase(t *testing.T) {
	t.Parallel()
	for name, fastPath := range map[string]time.Duration{"fast path": 0, "lease row": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			tr := newTraced(t)
			d := f.dedup(t, "billing", func(c *idem.Config) { c.Mode = &idem.LeaseConfig{FastPath: fastPath}; c.TracerProvider = tr.tp })
			provider := newKeyServer(t)
			var calls atomic.Int32
			_, err := d.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(publisher.NewEventID()))
			require.NoError(t, err)
			proc := tr.spans("process")
			require.Len(t, proc, 1)
			require.Equal(t, "processed", attr(proc[0], "idem.outcome").AsString())
			for _, name := range []string{"lease", "complete"} {
				s := tr.spans(name)
				require.Len(t, s, 1, name)
				require.Equal(t, proc[0].SpanContext.SpanID(), s[0].Parent.SpanID(), "%s is a child of the message's span", name)
			}
			require.Equal(t, "owned", attr(tr.spans("lease")[0], "idem.lease").AsString())
			require.Equal(t, fastPath == 0, attr(tr.spans("lease")[0], "idem.lease.fast_path").AsBool())
		})
	}
}

// A transaction-mode handler put in lease mode fails loudly, with a hint.
func TestLease_MustTxFromContextSaysWhy(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.leaseDedup(t, idem.LeaseConfig{})
	var got any
	_, err := d.Middleware(func(m *message.Message) (_ []*message.Message, err error) {
		defer func() {
			got = recover()
			err = errors.New("handler panicked")
		}()
		idem.MustTxFromContext(m.Context())
		return nil, nil
	})(f.msg(publisher.NewEventID()))
	require.Error(t, err)
	perr, ok := got.(error)
	require.True(t, ok)
	require.ErrorIs(t, perr, idem.ErrNotInHandler)
	require.ErrorContains(t, perr, "register its writes with idem.Complete")
	require.Zero(t, f.leases(t), "the failed delivery released its lease")
}

// lease returns c's lease-mode config.
func lease(c *idem.Config) *idem.LeaseConfig { return c.Mode.(*idem.LeaseConfig) }
