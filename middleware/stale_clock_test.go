package middleware_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// The stale guard re-reads the table's retention on its own clock
// (Config.NowFunc), the one the rule itself reads: a running consumer
// whose clock has passed RetentionRefreshInterval since it read the
// retention applies a shortened one, as the Cleaner on the same clock
// expects (it applies a shortening two intervals after the change).
// Before, the cache aged on the host's clock: a consumer on a simulated
// clock kept the old retention for good and accepted an event whose claim
// the Cleaner, on that clock, may already have deleted.
func TestStaleGuardRereadsTheRetentionOnItsOwnClock(t *testing.T) {
	t.Parallel()
	f := newStaleFixture(t, deduplicator.LayoutPlain)
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	h := f.handler(t, idem.Config{NowFunc: clock}, nil)
	threeDaysAgo := func() time.Time { return clock().Add(-3 * 24 * time.Hour) }

	_, err := h(staleMsg(staleIDAt(threeDaysAgo()))) // 3 days old, 7 days of retention
	require.NoError(t, err)

	require.NoError(t, dedupsql.SetRetention(context.Background(), f.db.Pool, f.table.Schema, f.table.Table, 24*time.Hour))
	mu.Lock()
	now = now.Add(deduplicator.RetentionRefreshInterval + time.Second)
	mu.Unlock()
	_, err = h(staleMsg(staleIDAt(threeDaysAgo()))) // 3 days old, 1 day of retention
	require.ErrorIs(t, err, deduplicator.ErrStaleEvent, "the retention was re-read on the consumer's clock")
	require.EqualValues(t, 1, f.calls.Load())
}
