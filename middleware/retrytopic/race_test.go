package retrytopic_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// blockedOnLock waits until a statement on the unit's table waits for a
// row lock.
func (u *unit) blockedOnLock(t *testing.T) {
	t.Helper()
	eventually(t, func() bool {
		return u.db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, u.db.Schema) == 1
	}, "a statement waits for the key's lock")
}

type waitResult struct {
	queued bool
	err    error
}

// The race rule of KeyOrder: a follower parks behind its key's head, and a
// release hands the key on, each under the lock of the key's first row. One
// actor is paused at its step while the other runs there; the follower is
// never left behind a head that is gone.
func TestKeyOrderParkRacesRelease(t *testing.T) {
	ctx := context.Background()

	// The release is open (e0's row deleted, e1 handed the key): a
	// follower parking now waits for it, then parks behind e1.
	t.Run("release open, follower parks", func(t *testing.T) {
		u := newUnit(t, nil)
		e0, e1, e2 := u.msg("k", 0), u.msg("k", 1), u.msg("k", 2)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		require.NoError(t, u.deliver(t, unitMain, e1))
		tx, err := u.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		handed, err := retrytopic.ReleaseTx(ctx, u.rt, tx, "k", u.eventID(e0))
		require.NoError(t, err)
		require.True(t, handed)
		res := make(chan waitResult, 1)
		go func() {
			q, err := retrytopic.Wait(ctx, u.rt, "k", u.eventID(e2), e2)
			res <- waitResult{q, err}
		}()
		u.blockedOnLock(t)
		require.NoError(t, tx.Commit(ctx))
		r := <-res
		require.NoError(t, r.err)
		require.True(t, r.queued)
		events, withCopy := u.parked(t, "k")
		require.Equal(t, ids(e1, e2), events)
		require.Equal(t, []bool{true, false}, withCopy)
	})

	// The release is open with nothing behind the head: the follower waits
	// for it, then finds its key free (and runs).
	t.Run("last release open, follower finds the key free", func(t *testing.T) {
		u := newUnit(t, nil)
		e0, e1 := u.msg("k", 0), u.msg("k", 1)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		tx, err := u.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		handed, err := retrytopic.ReleaseTx(ctx, u.rt, tx, "k", u.eventID(e0))
		require.NoError(t, err)
		require.False(t, handed)
		res := make(chan waitResult, 1)
		go func() {
			q, err := retrytopic.Wait(ctx, u.rt, "k", u.eventID(e1), e1)
			res <- waitResult{q, err}
		}()
		u.blockedOnLock(t)
		require.NoError(t, tx.Commit(ctx))
		r := <-res
		require.NoError(t, r.err)
		require.False(t, r.queued, "the key is free")
		events, _ := u.parked(t, "k")
		require.Empty(t, events)
	})

	// The follower's park is open (its row inserted behind e0, e0's row
	// locked): the release waits for it, then hands the key to it. Without
	// the lock the release would see no follower and free the key, and the
	// follower would wait for good.
	t.Run("park open, head released", func(t *testing.T) {
		u := newUnit(t, nil)
		e0, e1 := u.msg("k", 0), u.msg("k", 1)
		u.failNext(event{"k", 0}, 1)
		require.NoError(t, u.deliver(t, unitMain, e0))
		inserted, proceed := make(chan struct{}), make(chan struct{})
		follower := u.eventID(e1)
		retrytopic.SetHook(u.rt, func(s retrytopic.Step, id uuid.UUID) {
			if s == retrytopic.StepWaitInserted && id == follower {
				close(inserted)
				<-proceed
			}
		})
		res := make(chan waitResult, 1)
		go func() {
			q, err := retrytopic.Wait(ctx, u.rt, "k", follower, e1)
			res <- waitResult{q, err}
		}()
		<-inserted
		type releaseResult struct {
			handed bool
			err    error
		}
		released := make(chan releaseResult, 1)
		go func() {
			var handed bool
			err := pgx.BeginFunc(ctx, u.db.Pool, func(tx pgx.Tx) error {
				var err error
				handed, err = retrytopic.ReleaseTx(ctx, u.rt, tx, "k", u.eventID(e0))
				return err
			})
			released <- releaseResult{handed, err}
		}()
		u.blockedOnLock(t)
		close(proceed)
		r := <-res
		require.NoError(t, r.err)
		require.True(t, r.queued)
		rel := <-released
		require.NoError(t, rel.err)
		require.True(t, rel.handed, "the release saw the follower that parked while it waited")
		require.Equal(t, ids(e1), ids(u.handoffs(t)...))
		events, withCopy := u.parked(t, "k")
		require.Equal(t, ids(e1), events)
		require.Equal(t, []bool{true}, withCopy)
	})
}
