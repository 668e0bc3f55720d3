package deduplicator_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// groupsExamplePool connects to DATABASE_URL (or the local test database)
// with search_path set to a fresh schema, dropped by the returned cleanup.
func groupsExamplePool(ctx context.Context) (*pgxpool.Pool, string, func()) {
	return pgtest.ForExample(ctx, "example_groups")
}

// The retention is recorded with the table: Migrate records it for a new
// table, the middleware and the Cleaner read it, and a configured value that
// differs is refused. SetRetention changes it for every component: running
// consumers re-read it within RetentionRefreshInterval, so the Cleaner
// applies a shortening only twice that long later.
func ExampleSetRetention() {
	ctx := context.Background()
	pool, schema, cleanup := groupsExamplePool(ctx)
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema} // Retention zero: the recorded value
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	recorded, _ := deduplicator.RecordedRetention(ctx, pool, table)
	fmt.Println("recorded:", recorded)

	// A component configured with another value is refused, not obeyed.
	other := table
	other.Retention = 24 * time.Hour
	err := migrate.Up(ctx, pool, deduplicator.MigrationLine(other))
	fmt.Println("configured 24h:", errors.Is(err, deduplicator.ErrRetentionMismatch))

	// Lengthen it for DLQ replays: every component reads the new value.
	if err := deduplicator.SetRetention(ctx, pool, table, 30*24*time.Hour); err != nil {
		panic(err)
	}
	recorded, _ = deduplicator.RecordedRetention(ctx, pool, table)
	fmt.Println("recorded:", recorded)

	// Shorten it again: the Cleaner keeps the longer value until every
	// running consumer has re-read the shorter one.
	if err := deduplicator.SetRetention(ctx, pool, table, 7*24*time.Hour); err != nil {
		panic(err)
	}
	cleanerAt := func(now time.Time) deduplicator.Result {
		c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: pool, NowFunc: func() time.Time { return now }}, nil)
		if err != nil {
			panic(err)
		}
		res, err := c.RunOnce(ctx)
		if err != nil {
			panic(err)
		}
		return res
	}
	fmt.Println("cleaner applies now:", cleanerAt(time.Now()).Retention)
	fmt.Println("two refresh intervals later:", cleanerAt(time.Now().Add(2*deduplicator.RetentionRefreshInterval+time.Second)).Retention)
	// Output:
	// recorded: 168h0m0s
	// configured 24h: true
	// recorded: 720h0m0s
	// cleaner applies now: 720h0m0s
	// two refresh intervals later: 168h0m0s
}

// RenameGroup gives a consumer group's claims and registration to a new
// name in one transaction: events applied under the old name stay
// duplicates, and the new name keeps the old one's first-seen time and
// Idempotency-Key namespace, so downstream keys do not change. Stop the
// consumers first, move the Kafka offsets, start them under the new name,
// then ForgetGroup removes the old one.
func ExampleRenameGroup() {
	ctx := context.Background()
	pool, schema, cleanup := groupsExamplePool(ctx)
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	newDedup := func(group string) *deduplicator.Deduplicator {
		d, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: group}, nil)
		if err != nil {
			panic(err)
		}
		if _, err := d.Register(ctx, pool, ""); err != nil { // what the middleware does at start-up
			panic(err)
		}
		return d
	}
	claim := func(d *deduplicator.Deduplicator, id uuid.UUID) (first bool) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			first, err = d.Claim(ctx, tx, id)
			return err
		})
		if err != nil {
			panic(err)
		}
		return first
	}

	v1 := newDedup("billing-v1")
	applied := uuid.Must(uuid.NewV7())
	claim(v1, applied)
	claim(v1, uuid.Must(uuid.NewV7()))

	renamed, copied, err := deduplicator.RenameGroup(ctx, pool, table, "billing-v1", "billing-v2")
	if err != nil {
		panic(err)
	}
	fmt.Println("claims copied:", copied, "namespace:", renamed.IdempotencyNamespace)

	v2 := newDedup("billing-v2")
	fmt.Println("applied under v1, first for v2:", claim(v2, applied))

	groups, err := deduplicator.Groups(ctx, pool, table)
	if err != nil {
		panic(err)
	}
	for _, g := range groups {
		// First seen less than a retention ago: the Cleaner keeps every claim.
		fmt.Println(g.Name, g.IdempotencyNamespace, "young:", g.FirstSeen.After(time.Now().Add(-deduplicator.DefaultRetention)))
	}

	// Nothing consumes as billing-v1 any more: remove its claims and registration.
	forgotten, err := deduplicator.ForgetGroup(ctx, pool, table, "billing-v1")
	if err != nil {
		panic(err)
	}
	groups, _ = deduplicator.Groups(ctx, pool, table)
	fmt.Println("forgotten claims:", forgotten, "groups left:", len(groups), groups[0].Name)
	// Output:
	// claims copied: 2 namespace: billing-v1
	// applied under v1, first for v2: false
	// billing-v1 billing-v1 young: true
	// billing-v2 billing-v1 young: true
	// forgotten claims: 2 groups left: 1 billing-v2
}
