package deduplicator_test

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// retentionExamplePool connects to DATABASE_URL (or the local test database)
// with search_path set to a fresh schema, dropped by the returned cleanup.
func retentionExamplePool(ctx context.Context) (*pgxpool.Pool, string, func()) {
	return pgtest.ForExample(ctx, "example_retention")
}

// A Cleaner deletes the rows whose UUIDv7 event time is older than the
// retention, in batches of its own short transactions. Run it in every
// replica with Run (only one works at a time), or from cron with RunOnce.
func ExampleCleaner_RunOnce() {
	ctx := context.Background()
	pool, schema, cleanup := retentionExamplePool(ctx)
	defer cleanup()
	// One value for every component: Migrate records the retention with the
	// table, the middleware and the Cleaner read it from there.
	table := deduplicator.TableConfig{Schema: schema, Retention: 7 * 24 * time.Hour}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	now := time.Now()
	for _, created := range []time.Time{now.AddDate(0, 0, -8), now.AddDate(0, 0, -9), now.Add(-time.Hour)} {
		id := v7At(created) // a UUIDv7 created then
		if _, err := pool.Exec(ctx, "INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing')", id); err != nil {
			panic(err)
		}
	}

	cleaner, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{
		TableConfig: table,
		DB:          pool,
	}, nil)
	if err != nil {
		panic(err)
	}
	res, err := cleaner.RunOnce(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("deleted:", res.Deleted)
	// Output:
	// deleted: 2
}

// With LayoutPartitioned, Migrate creates processed_event RANGE-partitioned
// on event_id (one partition per UTC day plus a DEFAULT partition) or
// converts an existing plain table, and the Cleaner creates partitions ahead
// and drops those wholly older than the retention.
func ExampleCleaner_partitioned() {
	ctx := context.Background()
	pool, schema, cleanup := retentionExamplePool(ctx)
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema, Layout: deduplicator.LayoutPartitioned}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	var partitions int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_event'::regclass").Scan(&partitions)
	fmt.Println("partitions after Migrate:", partitions) // today, 3 days ahead, DEFAULT

	tenDaysLater := time.Now().AddDate(0, 0, 10)
	cleaner, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{
		TableConfig: table,
		DB:          pool,
		NowFunc:     func() time.Time { return tenDaysLater },
	}, nil)
	if err != nil {
		panic(err)
	}
	plan, err := cleaner.Plan(ctx) // what a pass would do; changes nothing
	if err != nil {
		panic(err)
	}
	fmt.Println("would create:", len(plan.PartitionsCreated), "would drop:", len(plan.PartitionsDropped))
	res, err := cleaner.RunOnce(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("created:", len(res.PartitionsCreated), "dropped:", len(res.PartitionsDropped))
	// Output:
	// partitions after Migrate: 5
	// would create: 4 would drop: 3
	// created: 4 dropped: 3
}

// v7At is a UUIDv7 whose time is t (its random bits zero), as a producer
// would have stamped at t.
func v7At(t time.Time) uuid.UUID {
	var u uuid.UUID
	ms := uint64(t.UnixMilli())
	for i := range 6 {
		u[i] = byte(ms >> (40 - 8*i))
	}
	u[6], u[8] = 0x70, 0x80 // version 7, variant 10
	return u
}
