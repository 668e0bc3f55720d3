package middleware_test

// Group commit against transaction mode: what a handler sees of its
// message (its cancellation) and what its panic does, settled by tests
// (issue 44's suspected defects).

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A message whose context ends (a rebalance) while its group runs does not
// fail the group: the group's statements run on one connection, and a
// cancelled statement would end it with the others' work (pgx closes a
// connection whose statement's context ends). The handler's statements
// run to the end in the group, and both messages commit together. Before,
// the cancelled message's statement failed, rolled its group back (the
// other handler ran again) and the message was nacked.
func TestGroupCommit_CancelledMessageDoesNotFailItsGroup(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", func(c *idem.Config) {
		c.Mode = &idem.GroupCommitConfig{MaxMessages: 3, MaxWait: time.Minute, Concurrency: 1}
	})
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	blockerID, release := publisher.NewEventID(), make(chan struct{})
	a, b := publisher.NewEventID(), publisher.NewEventID()
	aCtx, cancelA := context.WithCancel(context.Background())
	var bRuns atomic.Int32
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		switch id, _ := idem.EventIDFromContext(m.Context()); id {
		case blockerID:
			<-release
		case a:
			cancelA() // the rebalance takes A's partition while its handler runs
		case b:
			bRuns.Add(1)
		}
		return insert(m)
	})
	blocked := make(chan error, 1)
	go func() {
		_, err := h(f.msg(blockerID))
		blocked <- err
	}()
	require.Eventually(t, func() bool { return d.Stats().Groups == 1 }, 30*time.Second, time.Millisecond, "the blocker's group holds the slot")
	ma, mb := f.msg(a), f.msg(b)
	ma.SetContext(aCtx)
	var errs []error
	done := make(chan struct{})
	go func() { errs = deliverAll(h, []*message.Message{ma, mb}); close(done) }()
	require.Eventually(t, func() bool { return idem.OpenGroupSize(d) == 2 }, 30*time.Second, time.Millisecond, "A and B gather behind the blocker")
	close(release)
	require.NoError(t, <-blocked)
	<-done
	require.NoError(t, errs[0], "A completes in its group")
	require.NoError(t, errs[1])
	st := d.Stats()
	require.Zero(t, st.GroupFallbacks, "no rollback of the group")
	require.EqualValues(t, 2, st.Groups)
	require.EqualValues(t, 3, st.Processed)
	require.EqualValues(t, 1, bRuns.Load(), "B ran once")
	require.Equal(t, 3, f.ledgerRows(t))
	require.Equal(t, 3, f.claims(t))
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// A handler's panic behaves the same in both modes: it propagates from the
// middleware (to watermill's Recoverer, here) and nothing of the message
// commits; its handler is not run a second time first. Before, group
// commit turned the panic into an error and ran the message again alone,
// so a handler that panicked once was acked without the panic ever
// reaching the router (transaction mode re-raised it).
func TestGroupCommit_HandlerPanicPropagatesAsInTransactionMode(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	for name, group := range map[string]func(*idem.Config){
		"transaction":  nil,
		"group commit": func(c *idem.Config) { c.Mode = &idem.GroupCommitConfig{Concurrency: 1} },
	} {
		t.Run(name, func(t *testing.T) {
			d := f.dedup(t, "billing-"+name, group)
			var calls, runs atomic.Int32
			insert := f.insertHandler(1, &calls)
			id := publisher.NewEventID()
			h := wmiddleware.Recoverer(d.Middleware(func(m *message.Message) ([]*message.Message, error) {
				if runs.Add(1) == 1 {
					_, _ = insert(m) // written, then rolled back
					panic("handler bug")
				}
				return insert(m)
			}))
			_, err := h(f.msg(id))
			var rp wmiddleware.RecoveredPanicError
			require.ErrorAs(t, err, &rp, "the panic reaches the router")
			require.Equal(t, "handler bug", rp.V)
			require.EqualValues(t, 1, runs.Load(), "the handler ran once")
			require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", id))
			require.EqualValues(t, 1, d.Stats().Failed)

			_, err = h(f.msg(id)) // the redelivery applies it once
			require.NoError(t, err)
			require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", id))
			require.EqualValues(t, 1, d.Stats().Processed)
		})
	}
}
