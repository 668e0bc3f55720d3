package leasesql_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/leasetest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// leaseDB is a schema of its own with the deduplicator's tables, and the
// protocol of its processed_event table for group.
func leaseDB(t *testing.T, group string) (*pgtest.DB, *leasesql.Protocol) {
	t.Helper()
	db := pgtest.New(t, 6)
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	return db, leasesql.New(db.Schema, "processed_event", group)
}

// A lease goes owned → busy for others → completed (claim in, lease gone) →
// done for every later delivery; a completion with another token writes
// nothing.
func TestLease_TakeCompleteDuplicate(t *testing.T) {
	t.Parallel()
	db, p := leaseDB(t, "billing")
	a, b := leasetest.Req(publisher.NewEventID()), leasetest.Req(publisher.NewEventID())

	got := leasetest.Take(t, db, p, time.Minute, a, b)
	require.Equal(t, leasesql.Owned, got[0].State)
	require.Equal(t, leasesql.Owned, got[1].State)
	require.False(t, got[0].TakenOver)
	require.Equal(t, 1, got[0].Attempts)

	other := leasesql.Request{EventID: a.EventID, Token: uuid.New()}
	busy := leasetest.Take(t, db, p, time.Minute, other)[0]
	require.Equal(t, leasesql.Busy, busy.State)
	require.Greater(t, busy.Remaining, 50*time.Second, "the live lease's remaining time, on the database's clock")

	require.Equal(t, []leasesql.Result{leasesql.Lost}, leasetest.Complete(t, db, p, other), "a token that never held the lease")
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event"))
	require.Equal(t, []leasesql.Result{leasesql.Completed, leasesql.Completed}, leasetest.Complete(t, db, p, a, b))
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = 'billing'"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "a done event keeps no lease")

	again := leasetest.Take(t, db, p, time.Minute, leasetest.Req(a.EventID))[0]
	require.Equal(t, leasesql.Done, again.State)
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "a duplicate's take writes no lease")
	require.Equal(t, []leasesql.Result{leasesql.Lost}, leasetest.Complete(t, db, p, a), "completing twice")
}

// An expired lease is taken over with the new token; the first owner's
// completion and renewal then fail, and it writes nothing.
func TestLease_ExpiredLeaseIsTakenOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := leaseDB(t, "billing")
	first := leasetest.Req(publisher.NewEventID())
	require.Equal(t, leasesql.Owned, leasetest.Take(t, db, p, time.Minute, first)[0].State)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'") // its owner died

	second := leasetest.Req(first.EventID)
	got := leasetest.Take(t, db, p, time.Minute, second)[0]
	require.Equal(t, leasesql.Owned, got.State)
	require.True(t, got.TakenOver)
	require.Equal(t, 2, got.Attempts)

	renewed, err := p.Renew(ctx, db.Pool, first.EventID, first.Token, time.Minute)
	require.NoError(t, err)
	require.False(t, renewed, "the first owner's token is fenced off")
	require.Equal(t, []leasesql.Result{leasesql.Lost}, leasetest.Complete(t, db, p, first))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event"))
	require.Equal(t, []leasesql.Result{leasesql.Completed}, leasetest.Complete(t, db, p, second))
}

// Renewal keeps a lease live past its first expiry; release frees it at
// once, and the next take is a new lease, not a takeover.
func TestLease_RenewAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := leaseDB(t, "billing")
	r := leasetest.Req(publisher.NewEventID())
	leasetest.Take(t, db, p, time.Minute, r)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() + interval '1 millisecond'")
	ok, err := p.Renew(ctx, db.Pool, r.EventID, r.Token, time.Hour)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event_lease WHERE expires_at > now() + interval '59 minutes'"))

	ok, err = p.Release(ctx, db.Pool, r.EventID, uuid.New())
	require.NoError(t, err)
	require.False(t, ok, "another token releases nothing")
	ok, err = p.Release(ctx, db.Pool, r.EventID, r.Token)
	require.NoError(t, err)
	require.True(t, ok)
	got := leasetest.Take(t, db, p, time.Minute, leasetest.Req(r.EventID))[0]
	require.Equal(t, leasesql.Owned, got.State)
	require.False(t, got.TakenOver)
}

// The completion holds the lease row's lock until its COMMIT. A take that
// arrives meanwhile (the lease expired: it would take it over) waits for
// that COMMIT and then finds the event done: it neither runs the handler
// nor leaves a lease behind. Rolled back instead, the completion leaves the
// lease to the taker.
func TestLease_TakeWaitsForACompletionInFlight(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		t.Run(map[bool]string{true: "commit", false: "rollback"}[commit], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, p := leaseDB(t, "billing")
			owner := leasetest.Req(publisher.NewEventID())
			leasetest.Take(t, db, p, time.Minute, owner)
			db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'")

			tx, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			res, err := p.Complete(ctx, tx, []uuid.UUID{owner.EventID}, []uuid.UUID{owner.Token})
			require.NoError(t, err)
			require.Equal(t, []leasesql.Result{leasesql.Completed}, res)

			taker := leasetest.Req(owner.EventID)
			done := make(chan []leasesql.Take, 1)
			go func() {
				got, err := p.Take(ctx, db.Pool, []leasesql.Request{taker}, time.Minute, "taker")
				if err != nil {
					t.Error(err)
				}
				done <- got
			}()
			require.Eventually(t, func() bool {
				return db.Count(t, `SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO "' || $1 || '"."%_lease"%'`, db.Schema) == 1
			}, 30*time.Second, 10*time.Millisecond, "the taker waits for the completion's lock")
			select {
			case <-done:
				t.Fatal("the take returned while the completion held the lease")
			default:
			}
			if commit {
				require.NoError(t, tx.Commit(ctx))
				got := <-done
				require.Equal(t, leasesql.Done, got[0].State)
				require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "no lease left on a done event")
			} else {
				require.NoError(t, tx.Rollback(ctx))
				got := <-done
				require.Equal(t, leasesql.Owned, got[0].State)
				require.True(t, got[0].TakenOver)
			}
		})
	}
}

// A claim made in transaction mode counts: a lease-mode completion on the
// same event finds it and writes nothing (CompleteDuplicate).
func TestLease_CompleteAfterATransactionModeClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := leaseDB(t, "billing")
	r := leasetest.Req(publisher.NewEventID())
	leasetest.Take(t, db, p, time.Minute, r)
	d, err := deduplicator.New(deduplicator.Config{TableConfig: deduplicator.TableConfig{Schema: db.Schema}, ConsumerGroup: "billing"}, nil)
	require.NoError(t, err)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	first, err := d.Claim(ctx, tx, r.EventID)
	require.NoError(t, err)
	require.True(t, first)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []leasesql.Result{leasesql.Duplicate}, leasetest.Complete(t, db, p, r))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"))
}

// The same id twice in one batch: one delivery owns it, the other is busy.
func TestLease_SameIDTwiceInABatch(t *testing.T) {
	t.Parallel()
	db, p := leaseDB(t, "billing")
	id := publisher.NewEventID()
	got := leasetest.Take(t, db, p, time.Minute, leasetest.Req(id), leasetest.Req(id))
	require.Equal(t, leasesql.Owned, got[0].State)
	require.Equal(t, leasesql.Busy, got[1].State)
}
