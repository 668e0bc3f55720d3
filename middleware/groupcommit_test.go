package middleware_test

// Group commit (Config.Mode = &GroupCommitConfig{}): the failure scenarios of the
// one-message mode, driven with concurrent deliveries so that groups form,
// against a real PostgreSQL schema.

import (
	"context"
	"errors"
	"fmt"
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

// groupDedup is f.dedup in group mode. A generous MaxWait lets the
// concurrent deliveries of a test gather into few groups (a group that stops
// receiving still starts after MaxWait/5); nothing is timed.
func groupDedup(t *testing.T, f *ledgerFixture, group string) *idem.Dedup {
	return f.dedup(t, group, func(c *idem.Config) {
		c.Mode = &idem.GroupCommitConfig{MaxMessages: 16, MaxWait: 100 * time.Millisecond, Concurrency: 2}
	})
}

// deliverAll delivers msgs to h at the same time, one goroutine each, as the
// router does with one message in flight per partition, and returns each
// delivery's error (a panic becomes an error, as under watermill's
// Recoverer).
func deliverAll(h message.HandlerFunc, msgs []*message.Message) []error {
	h = wmiddleware.Recoverer(h)
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, m := range msgs {
		wg.Go(func() {
			<-start
			_, errs[i] = h(m)
		})
	}
	close(start)
	wg.Wait()
	return errs
}

func newIDs(n int) []uuid.UUID {
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = publisher.NewEventID()
	}
	return ids
}

func (f *ledgerFixture) msgs(ids []uuid.UUID) []*message.Message {
	out := make([]*message.Message, len(ids))
	for i, id := range ids {
		out[i] = f.msg(id)
	}
	return out
}

// Concurrent deliveries share transactions, each event is applied once, and
// a redelivery of all of them (a crash after COMMIT, before the acks) is
// acked without running a handler.
func TestGroupCommit_AppliesOnceAndRedeliveriesAreDuplicates(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(1, &calls))
	ids := newIDs(40)
	for i, err := range deliverAll(h, f.msgs(ids)) {
		require.NoError(t, err, "delivery %d", i)
	}
	st := d.Stats()
	require.EqualValues(t, 40, st.Processed)
	require.EqualValues(t, 40, st.GroupedMessages)
	require.Less(t, st.Groups, st.GroupedMessages, "messages shared transactions")
	require.EqualValues(t, 40, calls.Load())

	for i, err := range deliverAll(h, f.msgs(ids)) {
		require.NoError(t, err, "redelivery %d is acked", i)
	}
	require.EqualValues(t, 40, calls.Load(), "no handler ran for a redelivery")
	require.EqualValues(t, 40, d.Stats().Duplicates)
	require.Equal(t, 40, f.ledgerRows(t))
	require.Equal(t, 40, f.claims(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// A handler error rolls its group back; every message of the group is then
// processed alone: the others once, the failing one returns its error (a
// permanent one here) and stays alone on its later attempts.
func TestGroupCommit_HandlerErrorRollsBackTheGroupOthersApplyOnce(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	ids := newIDs(12)
	bad := ids[5]
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	var badRuns atomic.Int32
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if id, _ := idem.EventIDFromContext(m.Context()); id == bad {
			badRuns.Add(1)
			_, _ = insert(m) // written, then rolled back with its group
			return nil, idem.Permanent(errors.New("cannot apply"))
		}
		return insert(m)
	})
	errs := deliverAll(h, f.msgs(ids))
	for i, err := range errs {
		if ids[i] == bad {
			require.True(t, idem.IsPermanent(err), "the failing message returns its own error")
			continue
		}
		require.NoError(t, err)
	}
	st := d.Stats()
	require.EqualValues(t, 11, st.Processed)
	require.GreaterOrEqual(t, st.GroupFallbacks, uint64(1))
	require.Equal(t, 11, f.ledgerRows(t), "the rolled-back group left nothing; each good event applied once")
	require.Equal(t, 11, f.claims(t))
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", bad))

	// Its next attempt (Retry's, or a redelivery) goes alone at once: it
	// does not roll back a new group.
	fallbacks, alone := st.GroupFallbacks, st.Alone
	_, err := h(f.msg(bad))
	require.True(t, idem.IsPermanent(err))
	require.Equal(t, fallbacks, d.Stats().GroupFallbacks)
	require.Equal(t, alone+1, d.Stats().Alone)
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// A handler panic in a group: the group rolls back, the others apply once,
// and the panicking message panics again in its own delivery (here turned
// into an error by watermill's Recoverer), never acked.
func TestGroupCommit_HandlerPanicRollsBackTheGroup(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	ids := newIDs(8)
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if id, _ := idem.EventIDFromContext(m.Context()); id == ids[3] {
			panic("handler bug")
		}
		return insert(m)
	})
	for i, err := range deliverAll(h, f.msgs(ids)) {
		if i == 3 {
			var rp wmiddleware.RecoveredPanicError
			require.ErrorAs(t, err, &rp)
			require.Equal(t, "handler bug", rp.V)
			continue
		}
		require.NoError(t, err)
	}
	require.Equal(t, 7, f.ledgerRows(t))
	require.Equal(t, 7, f.claims(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// Two consumers of one group (a rebalance, a DLQ replay) get the same events
// at the same time, each in its own groups: every event is applied once in
// all, whichever group claims it first; the other's claim waits and skips.
func TestGroupCommit_ConcurrentDuplicatesAcrossGroups(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	a := groupDedup(t, f, "billing").Middleware(f.insertHandler(1, &calls))
	b := groupDedup(t, f, "billing").Middleware(f.insertHandler(2, &calls))
	ids := newIDs(30)
	var wg sync.WaitGroup
	var errsA, errsB []error
	wg.Go(func() { errsA = deliverAll(a, f.msgs(ids)) })
	wg.Go(func() { errsB = deliverAll(b, f.msgs(ids)) })
	wg.Wait()
	for i := range ids {
		require.NoError(t, errsA[i])
		require.NoError(t, errsB[i])
	}
	require.EqualValues(t, 30, calls.Load())
	require.Equal(t, 30, f.ledgerRows(t))
	require.Equal(t, 30, f.claims(t))
}

// The same events consumed by two consumer groups in group mode: each group
// applies each event once.
func TestGroupCommit_TwoConsumerGroupsEachProcessOnce(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var billingCalls, shippingCalls atomic.Int32
	billing := groupDedup(t, f, "billing").Middleware(f.insertHandler(10, &billingCalls))
	shipping := groupDedup(t, f, "shipping").Middleware(f.insertHandler(20, &shippingCalls))
	ids := newIDs(20)
	for range 2 {
		for _, err := range append(deliverAll(billing, f.msgs(ids)), deliverAll(shipping, f.msgs(ids))...) {
			require.NoError(t, err)
		}
	}
	require.EqualValues(t, 20, billingCalls.Load())
	require.EqualValues(t, 20, shippingCalls.Load())
	require.Equal(t, 20, f.db.Count(t, "SELECT 1 FROM ledger WHERE consumer_group = 'billing'"))
	require.Equal(t, 20, f.db.Count(t, "SELECT 1 FROM ledger WHERE consumer_group = 'shipping'"))
	require.Equal(t, 40, f.claims(t))
}

// A mixed group: new events, events already applied, two copies of one new
// event, and one poison message, through PoisonQueueWithFilter(IsPermanent)
// → dedup. Each new event is applied once, the duplicates and the copy are
// acked without running a handler, and only the bad one is poisoned.
func TestGroupCommit_MixedGroup(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	fresh, applied := newIDs(6), newIDs(4)
	poisonID := fresh[2]
	handler := func(m *message.Message) ([]*message.Message, error) {
		if id, _ := idem.EventIDFromContext(m.Context()); id == poisonID {
			return nil, fmt.Errorf("decode: %w", idem.ErrMalformedPayload)
		}
		return insert(m)
	}
	for _, err := range deliverAll(d.Middleware(handler), f.msgs(applied)) {
		require.NoError(t, err)
	}
	calls.Store(0)

	poisonPub := &badInputPoison{}
	poison, err := wmiddleware.PoisonQueueWithFilter(poisonPub, "billing-poison", idem.IsPermanent)
	require.NoError(t, err)
	h := poison(d.Middleware(handler))
	batch := append(f.msgs(fresh), f.msgs(applied)...)
	batch = append(batch, f.msg(fresh[0])) // a copy of a new event, in the same group
	for i, err := range deliverAll(h, batch) {
		require.NoError(t, err, "delivery %d ends processed, duplicate or poisoned", i)
	}
	require.GreaterOrEqual(t, calls.Load(), int32(5), "good new events ran (again after the fallback)")
	require.Equal(t, 5+4, f.ledgerRows(t))
	require.Equal(t, 5+4, f.claims(t))
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", poisonID))
	require.Len(t, poisonPub.all(), 1, "only the bad message is poisoned")
	require.Equal(t, poisonID.String(), poisonPub.all()[0].Metadata.Get(publisher.MetadataEventID))
}

// A COMMIT that fails (a deferred constraint, checked at COMMIT) nacks every
// message of the group, leaves nothing, and their redeliveries (alone or in
// a new group) apply each once.
func TestGroupCommit_CommitFailureNacksTheGroup(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	f.db.Exec(t, "CREATE TABLE once (k int, CONSTRAINT once_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
	// One slot: while a blocker holds it, the six deliveries gather into
	// one open group; once all six have joined the blocker is released, and
	// the group (its share of the six in flight) runs. A minute of MaxWait
	// only bounds a stall.
	d := f.dedup(t, "billing", func(c *idem.Config) {
		c.Mode = &idem.GroupCommitConfig{MaxMessages: 7, MaxWait: time.Minute, Concurrency: 1}
	})
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	blockerID, release := publisher.NewEventID(), make(chan struct{})
	var breakCommit atomic.Bool
	breakCommit.Store(true)
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if id, _ := idem.EventIDFromContext(m.Context()); id == blockerID {
			<-release
			return nil, nil
		}
		if _, err := insert(m); err != nil {
			return nil, err
		}
		// Every handler adds k=1: two of them in one transaction violate the
		// deferred constraint at COMMIT.
		if breakCommit.Load() {
			_, err := idem.MustTxFromContext(m.Context()).Exec(m.Context(), "INSERT INTO once VALUES (1)")
			return nil, err
		}
		return nil, nil
	})
	blocked := make(chan error, 1)
	go func() {
		_, err := h(f.msg(blockerID))
		blocked <- err
	}()
	require.Eventually(t, func() bool { return d.Stats().Groups == 1 }, 30*time.Second, time.Millisecond, "the blocker's group holds the slot")
	ids := newIDs(6)
	var errs []error
	done := make(chan struct{})
	go func() { errs = deliverAll(h, f.msgs(ids)); close(done) }()
	require.Eventually(t, func() bool { return idem.OpenGroupSize(d) == 6 }, 30*time.Second, time.Millisecond, "the six gather behind the blocker")
	close(release)
	require.NoError(t, <-blocked)
	<-done
	for _, err := range errs {
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, pgerrcode.UniqueViolation, pgErr.Code)
		require.False(t, idem.IsPermanent(err))
	}
	require.Equal(t, 1, f.claims(t), "only the blocker's claim")
	require.Zero(t, f.ledgerRows(t))

	breakCommit.Store(false)
	for _, err := range deliverAll(h, f.msgs(ids)) {
		require.NoError(t, err)
	}
	require.Equal(t, 6, f.ledgerRows(t))
	require.Equal(t, 7, f.claims(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

type ctxKey struct{}

// Each handler of a group sees its own message context (values the router
// or earlier middleware put there), its own event id, and the group's
// transaction, exactly as in the one-message mode; the message's original
// context is restored afterwards.
func TestGroupCommit_HandlersSeeTheirOwnContext(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	ids := newIDs(10)
	var mu sync.Mutex
	txs := map[pgx.Tx]int{}
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		id, ok := idem.EventIDFromContext(m.Context())
		if !ok || m.Context().Value(ctxKey{}) != id.String() {
			return nil, errors.New("handler sees another message's context")
		}
		tx, ok := idem.TxFromContext(m.Context())
		if !ok {
			return nil, errors.New("no tx")
		}
		mu.Lock()
		txs[tx]++
		mu.Unlock()
		return nil, nil
	})
	msgs := f.msgs(ids)
	orig := make([]context.Context, len(msgs))
	for i, m := range msgs {
		m.SetContext(context.WithValue(m.Context(), ctxKey{}, ids[i].String()))
		orig[i] = m.Context()
	}
	for _, err := range deliverAll(h, msgs) {
		require.NoError(t, err)
	}
	for i, m := range msgs {
		require.Equal(t, orig[i], m.Context(), "context restored")
	}
	require.Less(t, len(txs), 10, "handlers shared transactions")
	require.EqualValues(t, d.Stats().Groups, len(txs))
}

// Messages handlers return go to the outbox in the group's transaction.
func TestGroupCommit_ReturnedMessagesReachTheRouterAfterCommit(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte("next"))}, nil
	})
	ids := newIDs(10)
	outs := make([][]*message.Message, len(ids))
	var wg sync.WaitGroup
	for i, m := range f.msgs(ids) {
		wg.Go(func() {
			var err error
			outs[i], err = h(m)
			require.NoError(t, err)
		})
	}
	wg.Wait()
	for _, out := range outs {
		require.Len(t, out, 1, "each first delivery hands on its own returned message")
	}
	out, err := h(f.msg(ids[0]))
	require.NoError(t, err)
	require.Empty(t, out, "a duplicate returns nothing")
}

func TestGroupCommitConfigValidated(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	for _, gc := range []idem.GroupCommitConfig{{MaxMessages: -1}, {MaxWait: -1}, {Concurrency: -1}} {
		err := idem.Config{DB: f.pool, ConsumerGroup: "g", Mode: &gc}.Validate()
		require.ErrorContains(t, err, "(group commit)")
	}
	require.NoError(t, idem.Config{DB: f.pool, ConsumerGroup: "g", Mode: &idem.GroupCommitConfig{}}.Validate())
	tx, err := f.pool.Begin(context.Background())
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	require.ErrorContains(t, idem.Config{DB: tx, ConsumerGroup: "g", Mode: &idem.GroupCommitConfig{}}.Validate(), "group commit's DB is a pgx.Tx")
}

// panickingBeginner is a pool whose Begin panics once armed: a bug below the
// handlers (a driver, a wrapper) in the group's leader.
type panickingBeginner struct {
	pool interface {
		Begin(context.Context) (pgx.Tx, error)
	}
	armed atomic.Bool
}

func (b *panickingBeginner) Begin(ctx context.Context) (pgx.Tx, error) {
	if b.armed.Load() {
		panic("driver bug")
	}
	return b.pool.Begin(ctx)
}

// A panic in a group's leader outside the handlers (here in BEGIN) answers
// every message of the group with an error; before, the leader's panic left
// the others waiting for good, holding no transaction, and their
// partitions stopped.
func TestGroupCommit_LeaderPanicAnswersTheWholeGroup(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	db := &panickingBeginner{pool: f.pool}
	d := f.dedup(t, "billing", func(c *idem.Config) {
		c.DB = db
		c.Mode = &idem.GroupCommitConfig{MaxMessages: 16, MaxWait: 100 * time.Millisecond, Concurrency: 1}
	})
	db.armed.Store(true)
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(1, &calls))
	errs := deliverAll(h, f.msgs(newIDs(6)))
	panics := 0
	for _, err := range errs {
		require.Error(t, err)
		var rp wmiddleware.RecoveredPanicError
		if errors.As(err, &rp) {
			panics++
			continue
		}
		require.ErrorContains(t, err, "group commit panicked: driver bug")
	}
	require.GreaterOrEqual(t, panics, 1, "the leader's own panic goes on")
	require.Zero(t, calls.Load())

	// Disarmed, the redeliveries apply.
	db.armed.Store(false)
	for _, err := range deliverAll(h, f.msgs(newIDs(6))) {
		require.NoError(t, err)
	}
	require.Equal(t, 6, f.ledgerRows(t))
}
