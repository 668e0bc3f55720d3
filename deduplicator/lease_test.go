package deduplicator_test

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
	p := leasesql.New(db.Schema, "processed_event", "g")
	r := leasetest.Req(publisher.NewEventID())
	require.Equal(t, leasesql.Owned, leasetest.Take(t, db, p, time.Minute, r)[0].State)
	require.Equal(t, []leasesql.Result{leasesql.Completed}, leasetest.Complete(t, db, p, r))
}

// The Cleaner deletes leases that expired more than a retention ago; a
// live lease, or one expired less long ago, stays. Plan counts the same
// lease and deletes none.
func TestLease_CleanerSweepsOnlyLongExpiredLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := claimDB(t, "billing")
	p := leasesql.New(db.Schema, "processed_event", "billing")
	live, recent, ancient := leasetest.Req(publisher.NewEventID()), leasetest.Req(publisher.NewEventID()), leasetest.Req(publisher.NewEventID())
	leasetest.Take(t, db, p, time.Hour, live, recent, ancient)
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
