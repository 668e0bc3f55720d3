package leasesql_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/leasetest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Operators list and release leases; a released lease's owner then loses
// its completion.
func TestAdmin_ListAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := leaseDB(t, "billing")
	live, dead := leasetest.Req(publisher.NewEventID()), leasetest.Req(publisher.NewEventID())
	leasetest.Take(t, db, p, time.Minute, live, dead)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 second' WHERE event_id = $1", dead.EventID)

	all, err := leasesql.List(ctx, db.Pool, db.Schema, "", leasesql.Filter{})
	require.NoError(t, err)
	require.Len(t, all, 2)
	exp, err := leasesql.List(ctx, db.Pool, db.Schema, "processed_event", leasesql.Filter{State: "expired", ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Len(t, exp, 1)
	require.Equal(t, dead.EventID, exp[0].EventID)
	require.True(t, exp[0].Expired)
	require.Equal(t, "test", exp[0].Owner)
	_, err = leasesql.List(ctx, db.Pool, db.Schema, "", leasesql.Filter{State: "zombie"})
	require.ErrorContains(t, err, "zombie")

	sum, err := leasesql.Summarize(ctx, db.Pool, db.Schema, "")
	require.NoError(t, err)
	require.Equal(t, 1, sum.Live)
	require.Equal(t, 1, sum.Expired)

	ok, err := leasesql.ForceRelease(ctx, db.Pool, db.Schema, "", live.EventID, "billing")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, []leasesql.Result{leasesql.Lost}, leasetest.Complete(t, db, p, live))
	ok, err = leasesql.ForceRelease(ctx, db.Pool, db.Schema, "", live.EventID, "billing")
	require.NoError(t, err)
	require.False(t, ok, "released already")
}
