package middleware_test

// The stale-event guard: a UUIDv7 older than the retention minus StaleMargin
// is refused with ErrStaleEvent (its dedup row may be gone) when the consumer
// group is old enough to have lost claims; a UUIDv7 from the future is
// accepted and deduplicated like any other.

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// staleIDAt returns a UUIDv7 whose timestamp is t (random bits random).
func staleIDAt(t time.Time) uuid.UUID {
	id := uuid.Must(uuid.NewV7())
	floor := partition.Floor(t)
	copy(id[0:6], floor[0:6])
	return id
}

type staleFixture struct {
	db    *pgtest.DB
	table deduplicator.TableConfig
	calls atomic.Int32
}

func newStaleFixture(t *testing.T, layout deduplicator.Layout) *staleFixture {
	t.Helper()
	db := pgtest.New(t, 4)
	tc := deduplicator.TableConfig{Schema: db.Schema, Layout: layout}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(tc)))
	f := &staleFixture{db: db, table: tc}
	f.ageGroup(t, "g")
	return f
}

func (f *staleFixture) ageGroup(t *testing.T, group string) { ageGroup(t, f.db, group) }

func (f *staleFixture) handler(t *testing.T, cfg idem.Config, logger watermill.LoggerAdapter) message.HandlerFunc {
	t.Helper()
	cfg.DB, cfg.ConsumerGroup, cfg.Table = f.db.Pool, "g", f.table
	d, err := idem.NewDedup(cfg, logger)
	require.NoError(t, err)
	return d.Middleware(func(*message.Message) ([]*message.Message, error) {
		f.calls.Add(1)
		return nil, nil
	})
}

func staleMsg(id uuid.UUID) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	return m
}

func TestStaleGuardRefusesOnlyBeyondRetentionMinusMargin(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	now := time.UnixMilli(time.Now().UnixMilli()) // whole milliseconds, like a UUIDv7
	h := f.handler(t, idem.Config{NowFunc: func() time.Time { return now }}, nil)
	limit := deduplicator.DefaultRetention - deduplicator.DefaultStaleMargin // 7 days - 1 hour

	for _, tc := range []struct {
		name  string
		age   time.Duration
		stale bool
	}{
		{"fresh", time.Second, false},
		{"one ms inside the limit", limit - time.Millisecond, false},
		{"exactly at the limit", limit, false},
		{"one ms beyond the limit", limit + time.Millisecond, true},
		{"inside the margin, row may still exist", deduplicator.DefaultRetention - time.Minute, true},
		{"beyond the retention", deduplicator.DefaultRetention + time.Hour, true},
	} {
		id := staleIDAt(now.Add(-tc.age))
		before := f.calls.Load()
		_, err := h(staleMsg(id))
		if !tc.stale {
			require.NoError(t, err, tc.name)
			require.Equal(t, before+1, f.calls.Load(), tc.name)
			continue
		}
		require.ErrorIs(t, err, deduplicator.ErrStaleEvent, tc.name)
		require.True(t, idem.IsPermanent(err), tc.name)
		require.ErrorContains(t, err, id.String(), "%s: the error names the event", tc.name)
		require.Equal(t, before, f.calls.Load(), "%s: handler must not run", tc.name)
		require.Zero(t, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id), tc.name)
	}
}

func TestStaleGuardFollowsConfiguredRetention(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	now := time.Now()
	// A DLQ-replayed topic: 30 days of retention, 2 hours of margin.
	require.NoError(t, dedupsql.SetRetention(context.Background(), f.db.Pool, f.table.Schema, f.table.Table, 30*24*time.Hour))
	h := f.handler(t, idem.Config{StaleMargin: 2 * time.Hour, NowFunc: func() time.Time { return now }}, nil)
	_, err := h(staleMsg(staleIDAt(now.Add(-20 * 24 * time.Hour))))
	require.NoError(t, err)
	_, err = h(staleMsg(staleIDAt(now.Add(-30*24*time.Hour + time.Hour))))
	require.ErrorIs(t, err, deduplicator.ErrStaleEvent)
	require.EqualValues(t, 1, f.calls.Load())
}

func TestProcessStaleEventsProcessesOnceAnyway(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	h := f.handler(t, idem.Config{ProcessStaleEvents: true}, nil)
	id := staleIDAt(time.Now().Add(-90 * 24 * time.Hour))
	for range 3 {
		_, err := h(staleMsg(id))
		require.NoError(t, err)
	}
	require.EqualValues(t, 1, f.calls.Load(), "claimed again, so redeliveries are duplicates")
}

// A UUIDv7 from the far future (a producer with a wrong clock) is accepted:
// refusing would poison correct events for a clock fault, and keeping its row
// longer than needed never breaks dedup. In the partitioned layout it lands
// in the DEFAULT partition until its day comes within the ahead window.
func TestFutureEventIDIsAcceptedAndDeduplicated(t *testing.T) {
	t.Parallel()
	for _, layout := range []deduplicator.Layout{deduplicator.LayoutPlain, deduplicator.LayoutPartitioned} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			f := newStaleFixture(t, layout)
			h := f.handler(t, idem.Config{}, nil)
			id := staleIDAt(time.Now().AddDate(3, 0, 0))
			for range 2 {
				_, err := h(staleMsg(id))
				require.NoError(t, err)
			}
			require.EqualValues(t, 1, f.calls.Load())
			if layout == deduplicator.LayoutPartitioned {
				var part string
				require.NoError(t, f.db.Pool.QueryRow(context.Background(),
					"SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1", id).Scan(&part))
				require.Equal(t, partition.DefaultName("processed_event"), part)
			}
		})
	}
}

func TestNonV7IdsSkipTheStaleGuard(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	h := f.handler(t, idem.Config{AllowNonV7: true}, nil)
	_, err := h(staleMsg(uuid.New())) // v4: no time to check
	require.NoError(t, err)
	require.EqualValues(t, 1, f.calls.Load())
}

func TestAllowNonV7RefusedWithPartitionedLayout(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPartitioned)
	_, err := idem.NewDedup(idem.Config{DB: f.db.Pool, ConsumerGroup: "g", Table: f.table, AllowNonV7: true}, nil)
	require.ErrorContains(t, err, "AllowNonV7")
}

type staleLogCapture struct {
	watermill.NopLogger
	mu   sync.Mutex
	info []string
}

func (l *staleLogCapture) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.info = append(l.info, msg)
}
func (l *staleLogCapture) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func TestReplayHorizonLongerThanRetentionIsLogged(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	warn := &staleLogCapture{}
	f.handler(t, idem.Config{ReplayHorizon: 14 * 24 * time.Hour}, warn)
	require.Len(t, warn.info, 1)
	require.Contains(t, warn.info[0], "replay horizon")

	quiet := &staleLogCapture{}
	f.handler(t, idem.Config{ReplayHorizon: 24 * time.Hour}, quiet)
	require.NoError(t, dedupsql.SetRetention(context.Background(), f.db.Pool, f.table.Schema, f.table.Table, 30*24*time.Hour))
	f.handler(t, idem.Config{ReplayHorizon: 14 * 24 * time.Hour}, quiet)
	require.Empty(t, quiet.info)
}
