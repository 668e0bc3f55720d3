package deduplicator

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The interleaving harness of the Cleaner: a table, a ledger the "handler"
// writes in the claim's transaction (one row each time an event is
// applied), and the consumer groups that apply events.
type raceTable struct {
	t      *testing.T
	db     *pgtest.DB
	tc     TableConfig
	now    time.Time // the database's clock when the table was set up
	groups map[string]*Deduplicator
}

func newRaceTable(t *testing.T, layout Layout) *raceTable {
	t.Helper()
	db := pgtest.New(t, 6)
	tc := TableConfig{Schema: db.Schema, Layout: layout}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, MigrationLine(tc)))
	tc.setDefaults()
	db.Exec(t, "CREATE TABLE ledger (event_id uuid NOT NULL, consumer_group text NOT NULL)")
	r := &raceTable{t: t, db: db, tc: tc, groups: map[string]*Deduplicator{}}
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT now()").Scan(&r.now))
	return r
}

// register registers group (first seen now, on the database's clock).
func (r *raceTable) register(group string) {
	r.t.Helper()
	d, err := New(Config{TableConfig: r.tc, ConsumerGroup: group}, nil)
	require.NoError(r.t, err)
	_, err = d.Register(context.Background(), r.db.Pool, "")
	require.NoError(r.t, err)
	r.groups[group] = d
}

// veteran registers group as first seen before the registry existed: old
// enough to have lost claims, so the Cleaner deletes its old claims.
func (r *raceTable) veteran(group string) {
	r.t.Helper()
	r.register(group)
	r.db.Exec(r.t, "UPDATE "+r.tc.Table+"_group SET first_seen_at = '-infinity' WHERE consumer_group = $1", group)
}

// apply delivers id to group: claim and ledger row in one transaction, the
// ledger row only for the first claim (what the middleware does).
func (r *raceTable) apply(group string, ids ...uuid.UUID) {
	r.t.Helper()
	ctx := context.Background()
	for _, id := range ids {
		require.NoError(r.t, pgx.BeginFunc(ctx, r.db.Pool, func(tx pgx.Tx) error {
			first, err := r.groups[group].Claim(ctx, tx, id)
			if err != nil || !first {
				return err
			}
			_, err = tx.Exec(ctx, "INSERT INTO ledger VALUES ($1, $2)", id, group)
			return err
		}))
	}
}

// requireOnce asserts each id was applied exactly once for group.
func (r *raceTable) requireOnce(group string, ids ...uuid.UUID) {
	r.t.Helper()
	for _, id := range ids {
		require.Equal(r.t, 1, r.db.Count(r.t, "SELECT 1 FROM ledger WHERE event_id = $1 AND consumer_group = $2", id, group),
			"event %s applied for %s", id, group)
	}
}

// oldPartition creates the daily partition of day (before any row of it
// exists).
func (r *raceTable) oldPartition(day time.Time) {
	r.t.Helper()
	from, to := partition.Bounds(day)
	r.db.Exec(r.t, "CREATE TABLE "+partition.Name(r.tc.Table, day)+" PARTITION OF "+r.tc.Table+
		" FOR VALUES FROM ('"+from.String()+"') TO ('"+to.String()+"')")
}

// waitForLock waits until backend pid waits for a lock (a condition, polled).
func (r *raceTable) waitForLock(pid uint32) {
	r.t.Helper()
	require.Eventually(r.t, func() bool {
		return r.db.Count(r.t, "SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted", int32(pid)) > 0
	}, time.Minute, 5*time.Millisecond)
}

// The pause points of a pass.
type racePause string

const (
	pauseStart       racePause = "before it reads the groups"
	pauseBetween     racePause = "between batches"
	pauseDeleteWaits racePause = "inside a DELETE waiting on a row lock"
	pauseBeforeDrop  racePause = "before a partition DROP"
)

// A consumer group that registers at any moment of a pass, and
// a young group registered before it, keep every claim they make during the
// pass. The pass is paused at each of its steps; there a brand-new group
// registers and applies old events (allowed: it is young), a young group
// applies old events, and both are redelivered. After the pass, every one of
// them is redelivered again: each event is applied exactly once.
func TestCleanerRacesNewGroup(t *testing.T) {
	t.Parallel()
	for _, layout := range []Layout{LayoutPlain, LayoutPartitioned} {
		pauses := []racePause{pauseStart, pauseBetween, pauseDeleteWaits}
		if layout == LayoutPartitioned {
			pauses = append(pauses, pauseBeforeDrop)
		}
		for _, pause := range pauses {
			t.Run(fmt.Sprintf("%s/%s", layout, pause), func(t *testing.T) {
				raceNewGroup(t, layout, pause)
			})
		}
	}
}

func raceNewGroup(t *testing.T, layout Layout, pause racePause) {
	ctx := context.Background()
	r := newRaceTable(t, layout)
	st, err := dedupsql.ReadSetting(ctx, r.db.Pool, r.tc.Schema, r.tc.Table)
	require.NoError(t, err)
	ret := st.Retention
	r.veteran("veteran")
	r.register("young") // first seen now: young during the whole pass

	// The veteran's old claims fill the first batches (deleted by the
	// pass); the events applied during the pause sort after them, so the
	// pass meets them after the pause.
	var fillers []uuid.UUID
	for i := range 12 {
		fillers = append(fillers, v7At(r.now.Add(-ret-30*24*time.Hour+time.Duration(i)*time.Minute)))
	}
	r.apply("veteran", fillers...)
	newcomerOld := v7At(r.now.Add(-ret - 20*24*time.Hour))
	youngOld := v7At(r.now.Add(-ret - 20*24*time.Hour + time.Minute))
	newcomerIDs, youngIDs := []uuid.UUID{newcomerOld}, []uuid.UUID{youngOld}
	if layout == LayoutPartitioned {
		// An old partition, dropped by the pass unless a young group
		// claims in it first.
		day := partition.UTCDay(r.now.Add(-ret - 3*24*time.Hour))
		r.oldPartition(day)
		r.apply("veteran", v7At(day.Add(time.Hour)))
		newcomerIDs = append(newcomerIDs, v7At(day.Add(2*time.Hour)))
		youngIDs = append(youngIDs, v7At(day.Add(3*time.Hour)))
	}

	c, err := NewCleaner(CleanerConfig{TableConfig: r.tc, DB: r.db.Pool, BatchSize: 4}, nil)
	require.NoError(t, err)
	paused, resume := make(chan uint32), make(chan struct{})
	var blocker pgx.Tx
	defer func() {
		if blocker != nil {
			_ = blocker.Rollback(ctx)
		}
	}()
	stopAt := func(s step, n int) bool {
		switch pause {
		case pauseStart:
			return s == stepStart
		case pauseBetween:
			return s == stepBatch && n == 1
		case pauseDeleteWaits:
			return s == stepBatch && n == 0
		default:
			return s == stepDrop
		}
	}
	hit := false
	c.hook = func(s step, pid uint32, n int) {
		if hit || !stopAt(s, n) {
			return
		}
		hit = true
		if pause == pauseDeleteWaits {
			// A second session takes a row lock on a claim of the first
			// batch: the batch's DELETE waits for it.
			var err error
			blocker, err = r.db.Pool.Begin(ctx)
			if err == nil {
				_, err = blocker.Exec(ctx, "SELECT 1 FROM "+r.tc.Table+" WHERE event_id = $1 FOR UPDATE", fillers[1])
			}
			if err != nil {
				panic(err)
			}
			paused <- pid
			return
		}
		paused <- pid
		<-resume
	}
	done := runOnceAsync(ctx, c)
	var pid uint32
	select {
	case pid = <-paused:
	case out := <-done:
		t.Fatalf("the pass ended before the pause: %+v, %v", out.res, out.err)
	}
	if pause == pauseDeleteWaits {
		r.waitForLock(pid)
	}

	// The pause: a new group registers and applies old events, the young
	// group applies old events, and each is redelivered.
	r.register("newcomer")
	r.apply("newcomer", newcomerIDs...)
	r.apply("young", youngIDs...)
	r.apply("newcomer", newcomerIDs...)
	r.apply("young", youngIDs...)

	if pause == pauseDeleteWaits {
		require.NoError(t, blocker.Rollback(ctx))
	} else {
		close(resume)
	}
	out := <-done
	require.NoError(t, out.err)
	require.GreaterOrEqual(t, out.res.Deleted, int64(len(fillers)), "the veteran's old claims go")

	// Redelivered after the pass: still duplicates.
	r.apply("newcomer", newcomerIDs...)
	r.apply("young", youngIDs...)
	r.requireOnce("newcomer", newcomerIDs...)
	r.requireOnce("young", youngIDs...)
	if layout == LayoutPartitioned && (pause == pauseStart || pause == pauseBeforeDrop) {
		// Paused before the drop: the partition holds young claims by
		// then, so it is kept. Later, the claims of its range went to the
		// DEFAULT partition.
		require.Len(t, out.res.PartitionsKept, 1, "dropped %v", out.res.PartitionsDropped)
	}
}

// A shortening (30 → 7 days) while a consumer still runs with
// 30 days, with the Cleaner's host clock from 10 minutes behind to 10
// minutes ahead of the database's. The Cleaner keeps 30 days until twice
// RetentionRefreshInterval has passed on the database's clock, whatever its
// own clock says: the 20-day-old claim the consumer needs survives, and the
// redelivery is a duplicate.
func TestCleanerShorteningUnderClockSkew(t *testing.T) {
	t.Parallel()
	for _, layout := range []Layout{LayoutPlain, LayoutPartitioned} {
		t.Run(layout.String(), func(t *testing.T) {
			ctx := context.Background()
			r := newRaceTable(t, layout)
			r.veteran("billing")
			day := 24 * time.Hour
			for skew := -10 * time.Minute; skew <= 10*time.Minute; skew += time.Minute {
				// 30 days, set long ago; then shortened to 7 days just now.
				r.db.Exec(t, "UPDATE "+r.tc.Table+"_setting SET retention = interval '30 days', previous_retention = NULL, updated_at = now() - interval '1 day'")
				id := v7At(r.now.Add(-20*day + skew))
				r.apply("billing", id)
				require.NoError(t, dedupsql.SetRetention(ctx, r.db.Pool, r.tc.Schema, r.tc.Table, 7*day))

				c, err := NewCleaner(CleanerConfig{TableConfig: r.tc, DB: r.db.Pool}, nil)
				require.NoError(t, err)
				c.hostNow = func() time.Time { return time.Now().Add(skew) }
				res, err := c.RunOnce(ctx)
				require.NoError(t, err)
				require.Equal(t, 30*day, res.Retention, "skew %s", skew)
				require.InDelta(t, skew, res.ClockSkew, float64(5*time.Second), "the skewed host clock was read")

				r.apply("billing", id) // the consumer still on 30 days lets it through
				r.requireOnce("billing", id)
			}
		})
	}
}
