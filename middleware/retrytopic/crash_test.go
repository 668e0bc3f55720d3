package retrytopic_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// The failure table of docs/retry.md ("KeyOrder"), one case each: a crash
// is played by delivering again the message whose ack it lost, or by
// delivering a hand-off later or twice.
func TestKeyOrderFailureCases(t *testing.T) {
	t.Parallel()

	// A follower is redelivered on the main topic after the transaction
	// parking it committed (crash before the ack): its row holds it, it is
	// acked without running, and runs once, in its turn.
	t.Run("follower redelivered after its park committed", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1 := u.msg("k", 0), u.msg("k", 1)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0)) // fails: parked, copy published
		require.NoError(t, u.deliver(t, unitMain, e1)) // waits behind e0
		require.NoError(t, u.deliver(t, unitMain, e1)) // redelivered
		events, withCopy := u.parked(t, "k")
		require.Equal(t, ids(e0, e1), events)
		require.Equal(t, []bool{true, false}, withCopy, "only the head has a copy on the retry path")
		require.Empty(t, u.handoffs(t))

		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)))
		h := u.handoffs(t)
		require.Equal(t, ids(e1), ids(h...), "e0's release handed the key to e1")
		require.Equal(t, "0", h[0].Metadata.Get(retrytopic.MetadataAttempt))
		require.NoError(t, u.deliver(t, unitRetry, h[0]))
		require.Equal(t, []int{0, 1}, u.order(t, "k"))
		events, _ = u.parked(t, "k")
		require.Empty(t, events)
	})

	// A failover to an asynchronous standby (or a restore) undid the park
	// of a failed event: its copy, published before, is on the retry topic
	// while the database has no row and the key is free. The copy is acked
	// without running (the event comes again from the main topic, whose
	// position the database rewound, behind its key's earlier events that
	// the promotion undid too); a copy made without KeyOrder (no mark) still
	// runs when its key is free.
	t.Run("copy of a park a failover undid", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0 := u.msg("k", 0)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0)) // fails: parked, copy published
		c0 := u.lastCopy(t)
		require.Equal(t, "true", c0.Metadata.Get(retrytopic.MetadataParked))
		u.db.Exec(t, "DELETE FROM "+u.db.Schema+".retry_parked_key") // what the promoted standby lacks

		require.NoError(t, u.deliver(t, unitRetry, c0))
		require.Empty(t, u.order(t, "k"), "the copy of the undone park does not run")
		require.EqualValues(t, 1, u.rt.Stats().Stale)
		events, _ := u.parked(t, "k")
		require.Empty(t, events)
		require.NoError(t, u.deliver(t, unitMain, e0)) // the rewound main topic
		require.Equal(t, []int{0}, u.order(t, "k"))

		e1 := u.msg("k", 1)
		u.failNext(event{"k", 1}, 1)
		require.NoError(t, u.deliver(t, unitMain, e1))
		c1 := u.lastCopy(t)
		c1.Metadata.Set(retrytopic.MetadataParked, "") // made without KeyOrder
		u.db.Exec(t, "DELETE FROM "+u.db.Schema+".retry_parked_key")
		require.NoError(t, u.deliver(t, unitRetry, c1))
		require.Equal(t, []int{0, 1}, u.order(t, "k"), "an unmarked copy runs when its key is free")
	})

	// The head's copy is redelivered after the handler's COMMIT (claim,
	// release and hand-off): a duplicate; the key was handed on once.
	t.Run("head copy redelivered after its COMMIT", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitMain, e2))
		c0 := u.lastCopy(t)
		require.NoError(t, u.deliver(t, unitRetry, c0))
		require.NoError(t, u.deliver(t, unitRetry, c0)) // the lost ack
		require.Equal(t, ids(e1), ids(u.handoffs(t)...), "one hand-off")
		require.Equal(t, []int{0}, u.order(t, "k"))
		events, withCopy := u.parked(t, "k")
		require.Equal(t, ids(e1, e2), events)
		require.Equal(t, []bool{true, false}, withCopy)
		st := u.rt.Stats()
		require.EqualValues(t, 1, st.Stale, "the second copy of e0 found its key parked by e1: stale, acked")
	})

	// A hand-off is sent twice (the forwarder resends a batch after a
	// crash before its position COMMIT): the second copy is stale once the
	// event is done, and acked without running or parking again.
	t.Run("hand-off delivered twice", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitMain, e2))
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)))
		h1 := u.handoffs(t)[0]
		require.NoError(t, u.deliver(t, unitRetry, h1))
		require.NoError(t, u.deliver(t, unitRetry, h1)) // resent
		h := u.handoffs(t)
		require.Equal(t, ids(e1, e2), ids(h...), "e1 handed off once, then e2")
		require.NoError(t, u.deliver(t, unitRetry, h[1]))
		require.Equal(t, []int{0, 1, 2}, u.order(t, "k"))
		(&fixture{db: u.db}).eachAppliedOnce(t, 3)
		require.EqualValues(t, 1, u.rt.Stats().Stale)
		events, _ := u.parked(t, "k")
		require.Empty(t, events)
	})

	// Both copies of a hand-off arrive while the first is still the key's
	// head (the second before the first ran): the claim decides, the event
	// is applied once and the key handed on once.
	t.Run("hand-off delivered twice while its event is the head", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitMain, e2))
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)))
		h1 := u.handoffs(t)[0]
		u.failNext(event{"k", 1}, 1) // the first copy fails: e1 stays the head
		require.NoError(t, u.deliver(t, unitRetry, h1))
		require.NoError(t, u.deliver(t, unitRetry, h1))
		require.Equal(t, ids(e1, e2), ids(u.handoffs(t)...))
		c1 := u.lastCopy(t) // e1's attempt-1 copy
		require.Equal(t, ids(e1), ids(c1))
		require.NoError(t, u.deliver(t, unitRetry, c1)) // a duplicate by now
		require.Equal(t, ids(e1, e2), ids(u.handoffs(t)...), "no second hand-off")
		require.NoError(t, u.deliver(t, unitRetry, u.handoffs(t)[1]))
		require.Equal(t, []int{0, 1, 2}, u.order(t, "k"))
		(&fixture{db: u.db}).eachAppliedOnce(t, 3)
	})

	// The hand-off is committed but not forwarded yet (the forwarder is
	// down): the key waits, with the next event on the retry path; once
	// forwarded, the event runs.
	t.Run("hand-off forwarded late", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)))
		// e2 arrives while e1's hand-off waits in the outbox: it waits
		// behind e1.
		require.NoError(t, u.deliver(t, unitMain, e2))
		events, withCopy := u.parked(t, "k")
		require.Equal(t, ids(e1, e2), events)
		require.Equal(t, []bool{true, false}, withCopy)
		require.NoError(t, u.deliver(t, unitRetry, u.handoffs(t)[0]))
		require.NoError(t, u.deliver(t, unitRetry, u.handoffs(t)[1]))
		require.Equal(t, []int{0, 1, 2}, u.order(t, "k"))
	})

	// The key is released while a follower's park is being decided: e2
	// arrives on the main topic after e0's release committed with nothing
	// behind it, and runs at once (the key is free).
	t.Run("follower after the last release runs on the main topic", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		e0, e1 := u.msg("k", 0), u.msg("k", 1)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)))
		require.Empty(t, u.handoffs(t))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.Equal(t, []int{0, 1}, u.order(t, "k"))
	})

	// A poisoned head hands the key on.
	t.Run("poisoned head hands off", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, func(c *retrytopic.Config) { c.MaxAttempts = 1 })
		e0, e1 := u.msg("k", 0), u.msg("k", 1)
		u.failNext(event{"k", 0}, 2)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t))) // attempt 1 of 1 fails: poisoned
		require.EqualValues(t, 1, u.rt.Stats().Poisoned)
		require.Equal(t, ids(e1), ids(u.handoffs(t)...))
		require.NoError(t, u.deliver(t, unitRetry, u.handoffs(t)[0]))
		require.Equal(t, []int{1}, u.order(t, "k"))
	})

	// The head's copy never comes back: Unblock sends its stored message
	// again (through the outbox), or skips it and hands the key on.
	t.Run("head copy lost: unblock", func(t *testing.T) {
		t.Parallel()
		u := newUnit(t, nil)
		ctx := context.Background()
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0)) // its copy is lost
		require.NoError(t, u.deliver(t, unitMain, e1))
		require.NoError(t, u.deliver(t, unitMain, e2))

		_, err := retrytopic.Unblock(ctx, u.db.Pool, u.ob, u.table, unitGroup, "other", nil)
		require.ErrorIs(t, err, retrytopic.ErrKeyNotParked)
		res, err := retrytopic.Unblock(ctx, u.db.Pool, u.ob, u.table, unitGroup, "k", nil)
		require.NoError(t, err)
		require.Equal(t, retrytopic.UnblockResult{Head: u.eventID(e0), Topic: unitRetry, Resent: true}, *res)
		h := u.handoffs(t)
		require.Equal(t, ids(e0), ids(h...))
		require.Equal(t, "1", h[0].Metadata.Get(retrytopic.MetadataAttempt), "the copy that was lost: attempt 1")
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitRetry, h[0])) // fails again: attempt 2 is captured, and lost too

		res, err = retrytopic.Unblock(ctx, u.db.Pool, u.ob, u.table, unitGroup, "k", &retrytopic.UnblockOpts{Skip: true})
		require.NoError(t, err)
		next := u.eventID(e1)
		require.Equal(t, retrytopic.UnblockResult{Head: u.eventID(e0), Topic: unitRetry, Skipped: true, HandedOff: &next}, *res)
		h = u.handoffs(t)
		require.Equal(t, ids(e0, e1), ids(h...))
		require.NoError(t, u.deliver(t, unitRetry, h[1]))
		require.NoError(t, u.deliver(t, unitRetry, u.handoffs(t)[2]))
		require.Equal(t, []int{1, 2}, u.order(t, "k"), "e0 skipped: neither applied nor poisoned")
		require.NoError(t, u.deliver(t, unitRetry, u.lastCopy(t)), "e0's lost copy comes back after all")
		require.Equal(t, []int{1, 2}, u.order(t, "k"), "a copy made with KeyOrder whose row is gone is stale: e0 stays skipped (replay it)")
	})
}
