package deduplicator_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func take(t *testing.T, db *pgtest.DB, d *deduplicator.Deduplicator, dur time.Duration, reqs ...deduplicator.LeaseRequest) []deduplicator.LeaseTake {
	t.Helper()
	got, err := d.TakeLeases(context.Background(), db.Pool, reqs, dur, "test")
	require.NoError(t, err)
	require.Len(t, got, len(reqs))
	return got
}

func req(id uuid.UUID) deduplicator.LeaseRequest {
	return deduplicator.LeaseRequest{EventID: id, Token: uuid.New()}
}

func complete(t *testing.T, db *pgtest.DB, d *deduplicator.Deduplicator, reqs ...deduplicator.LeaseRequest) []deduplicator.CompleteResult {
	t.Helper()
	var ids, toks []uuid.UUID
	for _, r := range reqs {
		ids, toks = append(ids, r.EventID), append(toks, r.Token)
	}
	var res []deduplicator.CompleteResult
	inTx(t, db, func(tx pgx.Tx) {
		var err error
		res, err = d.CompleteLeases(context.Background(), tx, ids, toks)
		require.NoError(t, err)
	})
	return res
}

// A lease goes owned → busy for others → completed (claim in, lease gone) →
// done for every later delivery; a completion with another token writes
// nothing.
func TestLease_TakeCompleteDuplicate(t *testing.T) {
	t.Parallel()
	db, d := claimDB(t, "billing")
	a, b := req(publisher.NewEventID()), req(publisher.NewEventID())

	got := take(t, db, d, time.Minute, a, b)
	require.Equal(t, deduplicator.LeaseOwned, got[0].State)
	require.Equal(t, deduplicator.LeaseOwned, got[1].State)
	require.False(t, got[0].TakenOver)
	require.Equal(t, 1, got[0].Attempts)

	other := deduplicator.LeaseRequest{EventID: a.EventID, Token: uuid.New()}
	busy := take(t, db, d, time.Minute, other)[0]
	require.Equal(t, deduplicator.LeaseBusy, busy.State)
	require.Greater(t, busy.Remaining, 50*time.Second, "the live lease's remaining time, on the database's clock")

	require.Equal(t, []deduplicator.CompleteResult{deduplicator.CompleteLost}, complete(t, db, d, other), "a token that never held the lease")
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event"))
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.Completed, deduplicator.Completed}, complete(t, db, d, a, b))
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = 'billing'"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "a done event keeps no lease")

	again := take(t, db, d, time.Minute, req(a.EventID))[0]
	require.Equal(t, deduplicator.LeaseDone, again.State)
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "a duplicate's take writes no lease")
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.CompleteLost}, complete(t, db, d, a), "completing twice")
}

// An expired lease is taken over with the new token; the first owner's
// completion and renewal then fail, and it writes nothing.
func TestLease_ExpiredLeaseIsTakenOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	first := req(publisher.NewEventID())
	require.Equal(t, deduplicator.LeaseOwned, take(t, db, d, time.Minute, first)[0].State)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'") // its owner died

	second := req(first.EventID)
	got := take(t, db, d, time.Minute, second)[0]
	require.Equal(t, deduplicator.LeaseOwned, got.State)
	require.True(t, got.TakenOver)
	require.Equal(t, 2, got.Attempts)

	renewed, err := d.RenewLease(ctx, db.Pool, first.EventID, first.Token, time.Minute)
	require.NoError(t, err)
	require.False(t, renewed, "the first owner's token is fenced off")
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.CompleteLost}, complete(t, db, d, first))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event"))
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.Completed}, complete(t, db, d, second))
}

// Renewal keeps a lease live past its first expiry; release frees it at
// once, and the next take is a new lease, not a takeover.
func TestLease_RenewAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	r := req(publisher.NewEventID())
	take(t, db, d, time.Minute, r)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() + interval '1 millisecond'")
	ok, err := d.RenewLease(ctx, db.Pool, r.EventID, r.Token, time.Hour)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event_lease WHERE expires_at > now() + interval '59 minutes'"))

	ok, err = d.ReleaseLease(ctx, db.Pool, r.EventID, uuid.New())
	require.NoError(t, err)
	require.False(t, ok, "another token releases nothing")
	ok, err = d.ReleaseLease(ctx, db.Pool, r.EventID, r.Token)
	require.NoError(t, err)
	require.True(t, ok)
	got := take(t, db, d, time.Minute, req(r.EventID))[0]
	require.Equal(t, deduplicator.LeaseOwned, got.State)
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
			db, d := claimDB(t, "billing")
			owner := req(publisher.NewEventID())
			take(t, db, d, time.Minute, owner)
			db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second'")

			tx, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			res, err := d.CompleteLeases(ctx, tx, []uuid.UUID{owner.EventID}, []uuid.UUID{owner.Token})
			require.NoError(t, err)
			require.Equal(t, []deduplicator.CompleteResult{deduplicator.Completed}, res)

			taker := req(owner.EventID)
			done := make(chan []deduplicator.LeaseTake, 1)
			go func() {
				got, err := d.TakeLeases(ctx, db.Pool, []deduplicator.LeaseRequest{taker}, time.Minute, "taker")
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
				require.Equal(t, deduplicator.LeaseDone, got[0].State)
				require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"), "no lease left on a done event")
			} else {
				require.NoError(t, tx.Rollback(ctx))
				got := <-done
				require.Equal(t, deduplicator.LeaseOwned, got[0].State)
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
	db, d := claimDB(t, "billing")
	r := req(publisher.NewEventID())
	take(t, db, d, time.Minute, r)
	inTx(t, db, func(tx pgx.Tx) {
		first, err := d.Claim(ctx, tx, r.EventID)
		require.NoError(t, err)
		require.True(t, first)
	})
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.CompleteDuplicate}, complete(t, db, d, r))
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"))
}

// The same id twice in one batch: one delivery owns it, the other is busy.
func TestLease_SameIDTwiceInABatch(t *testing.T) {
	t.Parallel()
	db, d := claimDB(t, "billing")
	id := publisher.NewEventID()
	got := take(t, db, d, time.Minute, req(id), req(id))
	require.Equal(t, deduplicator.LeaseOwned, got[0].State)
	require.Equal(t, deduplicator.LeaseBusy, got[1].State)
}

// Operators list and release leases; a released lease's owner then loses
// its completion.
func TestLease_ListAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	tc := deduplicator.TableConfig{Schema: db.Schema}
	live, dead := req(publisher.NewEventID()), req(publisher.NewEventID())
	take(t, db, d, time.Minute, live, dead)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second' WHERE event_id = $1", dead.EventID)

	all, err := deduplicator.ListLeases(ctx, db.Pool, tc, deduplicator.LeaseFilter{})
	require.NoError(t, err)
	require.Len(t, all, 2)
	exp, err := deduplicator.ListLeases(ctx, db.Pool, tc, deduplicator.LeaseFilter{State: "expired", ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Len(t, exp, 1)
	require.Equal(t, dead.EventID, exp[0].EventID)
	require.True(t, exp[0].Expired)
	require.Equal(t, "test", exp[0].Owner)
	_, err = deduplicator.ListLeases(ctx, db.Pool, tc, deduplicator.LeaseFilter{State: "zombie"})
	require.ErrorContains(t, err, "zombie")

	ok, err := deduplicator.ReleaseLeaseOf(ctx, db.Pool, tc, live.EventID, "billing")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.CompleteLost}, complete(t, db, d, live))
}

// A table migrated to the partitioned layout before the lease version
// existed gets it on the next Up, below version 100.
func TestLease_MigrationBelowAnAppliedPartitionedVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	part := deduplicator.TableConfig{Schema: db.Schema, Layout: deduplicator.LayoutPartitioned}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(part)))
	db.Exec(t, "DROP TABLE processed_event_lease")
	db.Exec(t, "DELETE FROM idem_schema_migration WHERE version = 3")
	require.Error(t, deduplicator.Check(ctx, db.Pool, part))
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(part)))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, part))
	d, err := deduplicator.New(deduplicator.Config{TableConfig: part, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	r := req(publisher.NewEventID())
	require.Equal(t, deduplicator.LeaseOwned, take(t, db, d, time.Minute, r)[0].State)
	require.Equal(t, []deduplicator.CompleteResult{deduplicator.Completed}, complete(t, db, d, r))
}

// The Cleaner deletes leases that expired more than a retention ago; a
// live lease, or one expired less long ago, stays. Plan counts the same
// lease and deletes none.
func TestLease_CleanerSweepsOnlyLongExpiredLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	live, recent, ancient := req(publisher.NewEventID()), req(publisher.NewEventID()), req(publisher.NewEventID())
	take(t, db, d, time.Hour, live, recent, ancient)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 hour' WHERE event_id = $1", recent.EventID)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '400 days' WHERE event_id = $1", ancient.EventID)
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: deduplicator.TableConfig{Schema: db.Schema}, DB: db.Pool}, nil)
	require.NoError(t, err)
	plan, err := c.Plan(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, plan.LeasesDeleted)
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM processed_event_lease"), "a plan deletes no lease")
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.LeasesDeleted)
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event_lease WHERE event_id = ANY($1)", []uuid.UUID{live.EventID, recent.EventID}))
}

// Every statement of a take reaches the claim table through its primary
// key, whatever the plan cache picks: a seq scan of the claim table on
// every take (a hashed EXISTS subplan, which PostgreSQL picked for the
// state read while the table had tens of thousands of rows and no
// statistics yet) costs milliseconds per batch and grows with the table.
func TestLease_TakeReadsClaimsByIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, d := claimDB(t, "billing")
	db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group) SELECT gen_random_uuid(), 'billing' FROM generate_series(1, 30000)")
	ids, toks := make([]uuid.UUID, 64), make([]uuid.UUID, 64)
	for i := range ids {
		ids[i], toks[i] = publisher.NewEventID(), uuid.New()
	}
	take, recheck, state := deduplicator.LeaseTakeSQL(d)
	// Before the table's first ANALYZE (the planner guesses its size from
	// its pages), then after it.
	for _, mode := range []string{"force_custom_plan", "force_generic_plan", "analyze", "force_custom_plan", "force_generic_plan"} {
		if mode == "analyze" {
			db.Exec(t, "ANALYZE processed_event")
			continue
		}
		for name, st := range map[string]struct {
			sql  string
			args []any
		}{
			"take":    {take, []any{ids, toks, "billing", int64(time.Minute / time.Microsecond), "test"}},
			"recheck": {recheck, []any{toks, "billing", ids}},
			"state":   {state, []any{ids, "billing", toks}},
		} {
			inTx(t, db, func(tx pgx.Tx) {
				_, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode)
				require.NoError(t, err)
				var plan string
				require.NoError(t, tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+st.sql, st.args...).Scan(&plan))
				require.NotRegexp(t, `"Node Type": "Seq Scan",[^}]*"Relation Name": "processed_event"`, plan,
					"%s (%s) scans the claim table", name, mode)
			})
		}
	}
}
