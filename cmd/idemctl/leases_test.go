package main_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/leasesql"
)

type leasesJSON struct {
	Leases []leasesql.Lease `json:"leases"`
}

// An operator lists live and expired leases and releases one; the
// released lease's owner then completes nothing.
func TestDedupLeasesAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain")
	p := leasesql.New(db.Schema, "processed_event", "billing")
	live, dead := leasesql.Request{EventID: v7At(time.Now()), Token: uuid.New()}, leasesql.Request{EventID: v7At(time.Now()), Token: uuid.New()}
	_, err := p.Take(ctx, db.Pool, []leasesql.Request{live, dead}, time.Hour, "host-a:42")
	require.NoError(t, err)
	db.Exec(t, "UPDATE processed_event_lease SET expires_at = now() - interval '1 minute' WHERE event_id = $1", dead.EventID)

	r := ok(t, db, "dedup", "leases")
	require.Regexp(t, live.EventID.String()+`\s+billing\s+live\s+.*host-a:42`, r.Stdout)
	require.Regexp(t, dead.EventID.String()+`\s+billing\s+expired`, r.Stdout)
	l := decode[leasesJSON](t, ok(t, db, "dedup", "leases", "--state", "expired", "--json"))
	require.Len(t, l.Leases, 1)
	require.Equal(t, dead.EventID, l.Leases[0].EventID)
	fails(t, db, 2, "--state", "dedup", "leases", "--state", "zombie")

	fails(t, db, 2, "--yes", "dedup", "release", live.EventID.String(), "--group", "billing")
	r = ok(t, db, "dedup", "release", live.EventID.String(), "--group", "billing", "--yes")
	require.Contains(t, r.Stdout, "released the lease of "+live.EventID.String())
	require.Contains(t, ok(t, db, "dedup", "release", live.EventID.String(), "--group", "billing", "--yes").Stdout, "no lease of")
	require.Equal(t, "no leases\n", ok(t, db, "dedup", "leases", "--state", "live").Stdout)
}
