package deduplicator

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/stretchr/testify/require"
)

// Two shortenings within the window (30 → 7 → 1 days) keep the longest value
// a running consumer may still hold: the Cleaner applies 30 days until every
// consumer has re-read the change, then 1 day.
func TestSetRetentionTwiceInTheWindowKeepsTheLongest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tc := retentionDB(t, LayoutPlain)
	day := 24 * time.Hour
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, tc.Schema, tc.Table, 30*day))
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, tc.Schema, tc.Table, 7*day))
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, tc.Schema, tc.Table, day))
	at := func(now time.Time) time.Duration {
		c, err := NewCleaner(CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: func() time.Time { return now }}, nil)
		require.NoError(t, err)
		res, err := c.RunOnce(ctx)
		require.NoError(t, err)
		return res.Retention
	}
	require.Equal(t, 30*day, at(time.Now()))
	require.Equal(t, day, at(time.Now().Add(2*RetentionRefreshInterval+time.Second)))
}
