package middleware_test

// Settings that must agree across components: the
// retention has one source of truth (the table), a new consumer group drains
// an old backlog, and a renamed group keeps its Idempotency-Keys.

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The reported case: a Cleaner with Retention 24h next to a middleware with
// the default 7 days deleted a 2-day-old claim, and the redelivery applied the
// event a second time. Now the Cleaner reads the recorded retention and
// refuses a different one; after shortening it for everyone (SetRetention)
// the Cleaner keeps the previous value until every running consumer has
// re-read it, and then the stale guard refuses the redelivery instead of
// applying it again.
func TestRetentionHasOneSourceOfTruth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	table := deduplicator.TableConfig{Schema: f.db.Schema}
	const group = "billing"
	ageGroup(t, f.db, group) // running for longer than the retention
	now := time.Now()
	clock := func() time.Time { return now }

	var calls atomic.Int32
	h := f.dedup(t, group, func(c *idem.Config) { c.NowFunc = clock }).Middleware(f.insertHandler(1, &calls))
	id := staleIDAt(now.Add(-48 * time.Hour))
	_, err := h(f.msg(id))
	require.NoError(t, err)

	// The misconfigured Cleaner of the report is refused; nothing is deleted.
	short := table
	short.Retention = 24 * time.Hour
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: short, DB: f.pool, NowFunc: clock}, nil)
	require.NoError(t, err)
	_, err = c.RunOnce(ctx)
	require.ErrorIs(t, err, deduplicator.ErrRetentionMismatch)
	require.Equal(t, 1, f.claims(t))
	_, err = h(f.msg(id)) // redelivery: a duplicate
	require.NoError(t, err)
	require.EqualValues(t, 1, calls.Load())

	// So is a middleware configured with another retention than the table's.
	_, err = idem.NewDedup(idem.Config{DB: f.pool, ConsumerGroup: group, Table: short}, nil)
	require.ErrorIs(t, err, deduplicator.ErrRetentionMismatch)

	// Shortening it for every component: running consumers may still guard
	// with 7 days until they re-read it, so for two refresh intervals the
	// Cleaner keeps applying 7 days and deletes nothing.
	require.NoError(t, dedupsql.SetRetention(ctx, f.pool, table.Schema, table.Table, 24*time.Hour))
	setAt := time.Now() // after the change's updated_at (the database's now() of its committed transaction)
	c, err = deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: f.pool, NowFunc: clock}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 7*24*time.Hour, res.Retention)
	require.Zero(t, res.Deleted)
	_, err = h(f.msg(id)) // the running consumer, on its 7-day view: a duplicate
	require.NoError(t, err)
	require.EqualValues(t, 1, calls.Load())

	// Once every consumer has re-read it (here: restarted), the Cleaner
	// deletes the claim at 24 hours, and the redelivery is refused as stale,
	// never applied again.
	// Measured from the change, not from now: on a loaded machine the steps
	// above can take longer than the second of margin.
	later := func() time.Time { return setAt.Add(2*deduplicator.RetentionRefreshInterval + time.Second) }
	h = f.dedup(t, group, func(c *idem.Config) { c.NowFunc = later }).Middleware(f.insertHandler(1, &calls))
	c, err = deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: f.pool, NowFunc: later}, nil)
	require.NoError(t, err)
	res, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Deleted)
	require.Equal(t, 24*time.Hour, res.Retention)
	_, err = h(f.msg(id))
	require.ErrorIs(t, err, deduplicator.ErrStaleEvent)
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, f.ledgerRows(t))
}

// Lengthening the retention does not revive the events whose claims the
// Cleaner already deleted under the shorter one: the table records the
// Cleaner's highest cutoff, and the guard keeps refusing events before it.
func TestLengtheningRetentionKeepsCleanedEventsStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	table := deduplicator.TableConfig{Schema: f.db.Schema}
	const group = "billing"
	ageGroup(t, f.db, group)
	now := time.Now()
	var calls atomic.Int32
	h := f.dedup(t, group, func(c *idem.Config) { c.NowFunc = func() time.Time { return now } }).Middleware(f.insertHandler(1, &calls))
	id := staleIDAt(now.Add(-6 * 24 * time.Hour))
	_, err := h(f.msg(id))
	require.NoError(t, err)

	// Two days later the claim is older than 7 days: cleaned.
	later := func() time.Time { return now.Add(2 * 24 * time.Hour) }
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: f.pool, NowFunc: later}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Deleted)

	// 30 days from now on: the event is inside the new retention, but its
	// claim is gone, so the restarted consumer refuses it.
	require.NoError(t, dedupsql.SetRetention(ctx, f.pool, table.Schema, table.Table, 30*24*time.Hour))
	h = f.dedup(t, group, func(c *idem.Config) { c.NowFunc = later }).Middleware(f.insertHandler(1, &calls))
	_, err = h(f.msg(id))
	require.ErrorIs(t, err, deduplicator.ErrStaleEvent)
	require.ErrorContains(t, err, "cleanup horizon")
	require.EqualValues(t, 1, calls.Load())
	// An event created after the cleanup horizon is processed normally.
	_, err = h(f.msg(staleIDAt(now.Add(-4 * 24 * time.Hour))))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
}

// §8: a brand-new group reading an old topic from the oldest offset applies
// a backlog older than the retention once (none of its claims can have been
// cleaned, and the Cleaner keeps them); once the group is older than the
// retention, its cleaned claims make the guard refuse the same events.
func TestNewGroupDrainsBacklogOlderThanRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	table := deduplicator.TableConfig{Schema: f.db.Schema}
	now := time.Now()

	var calls atomic.Int32
	h := f.dedup(t, "late-joiner", nil).Middleware(f.insertHandler(1, &calls))
	var backlog []uuid.UUID
	for i := range 5 {
		backlog = append(backlog, staleIDAt(now.Add(-time.Duration(10+i)*24*time.Hour)))
	}
	for _, id := range backlog {
		_, err := h(f.msg(id))
		require.NoError(t, err, "a never-processed event of a new group is not stale")
	}
	require.EqualValues(t, 5, calls.Load())

	// The Cleaner keeps a young group's claims, whatever the event's age...
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: f.pool}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Deleted)
	require.Equal(t, []string{"late-joiner"}, res.YoungGroups)
	// ...so a redelivery during the drain is a duplicate, not a second apply.
	for _, id := range backlog {
		_, err := h(f.msg(id))
		require.NoError(t, err)
	}
	require.EqualValues(t, 5, calls.Load())

	// Eight days later the group is older than the retention: the Cleaner
	// deletes those claims and the group's guard refuses the events.
	later := func() time.Time { return now.Add(8 * 24 * time.Hour) }
	c, err = deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: f.pool, NowFunc: later}, nil)
	require.NoError(t, err)
	res, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Deleted)
	require.Empty(t, res.YoungGroups)
	h = f.dedup(t, "late-joiner", func(c *idem.Config) { c.NowFunc = later }).Middleware(f.insertHandler(1, &calls))
	for _, id := range backlog {
		_, err := h(f.msg(id))
		require.ErrorIs(t, err, deduplicator.ErrStaleEvent)
	}
	require.EqualValues(t, 5, calls.Load())
	require.Equal(t, 5, f.ledgerRows(t))
}

// §8, the other side: an old group whose claims were cleaned still refuses
// stale events (they may have been applied before).
func TestOldGroupWithCleanedClaimsRefusesStaleEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	const group = "veteran"
	ageGroup(t, f.db, group)
	var calls atomic.Int32
	h := f.dedup(t, group, nil).Middleware(f.insertHandler(1, &calls))
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: deduplicator.TableConfig{Schema: f.db.Schema}, DB: f.pool}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Empty(t, res.YoungGroups)
	_, err = h(f.msg(staleIDAt(time.Now().Add(-10 * 24 * time.Hour))))
	require.ErrorIs(t, err, deduplicator.ErrStaleEvent)
	require.True(t, idem.IsPermanent(err))
	require.Zero(t, calls.Load())
}

// §9: the group-rename procedure (stop, RenameGroup, start under the new
// name) keeps named Idempotency-Keys. A charge that reached the provider
// under the old name, whose transaction then rolled back, is retried under
// the new name with the same key, so the provider applies it once.
func TestRenameGroupKeepsIdempotencyKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	srv := newKeyServer(t)
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(srv.Client().Transport, "charge")}
	errLost := errors.New("response lost")
	var failNext atomic.Bool
	var runs atomic.Int32
	charge := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		req, err := http.NewRequestWithContext(msg.Context(), http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		_ = resp.Body.Close()
		if failNext.CompareAndSwap(true, false) {
			return nil, errLost
		}
		return nil, nil
	}
	consumer := func(group string) message.HandlerFunc {
		d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: group, Table: table}, nil)
		require.NoError(t, err)
		return d.Middleware(charge)
	}
	msgOf := func(id uuid.UUID) *message.Message {
		m := message.NewMessage(uuid.NewString(), []byte(`{}`))
		m.Metadata.Set("event_id", id.String())
		return m
	}

	old := consumer("billing-v1")
	done, pending := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	_, err := old(msgOf(done))
	require.NoError(t, err)
	failNext.Store(true)
	_, err = old(msgOf(pending)) // charged, then rolled back
	require.ErrorIs(t, err, errLost)

	g, copied, err := deduplicator.RenameGroup(ctx, db.Pool, table, "billing-v1", "billing-v2")
	require.NoError(t, err)
	require.EqualValues(t, 1, copied)
	require.Equal(t, "billing-v1", g.IdempotencyNamespace)

	renamed := consumer("billing-v2")
	_, err = renamed(msgOf(done)) // applied under the old name: a duplicate
	require.NoError(t, err)
	_, err = renamed(msgOf(pending)) // the retried charge
	require.NoError(t, err)
	require.EqualValues(t, 3, runs.Load(), "done once, pending twice (rolled back, then retried)")

	keys := srv.Keys()
	require.Len(t, keys, 3)
	require.Equal(t, keys[1], keys[2], "the retry after the rename reuses the key: the provider applies the charge once")
	distinct := map[string]bool{}
	for _, k := range keys {
		distinct[k] = true
	}
	require.Len(t, distinct, 2, "two charges at the provider, one per event")

	// The namespace is recorded: configuring another one is refused.
	_, err = idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing-v2", Table: table, IdempotencyNamespace: "billing-v2"}, nil)
	require.ErrorIs(t, err, deduplicator.ErrNamespaceMismatch)
	// Renaming onto a name in use is refused; the old name can be forgotten.
	_, _, err = deduplicator.RenameGroup(ctx, db.Pool, table, "billing-v1", "billing-v2")
	require.ErrorIs(t, err, deduplicator.ErrGroupExists)
	n, err := deduplicator.ForgetGroup(ctx, db.Pool, table, "billing-v1")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	_, err = deduplicator.ForgetGroup(ctx, db.Pool, table, "billing-v1")
	require.ErrorIs(t, err, deduplicator.ErrGroupNotFound)
}
