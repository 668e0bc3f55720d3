package migrate_test

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// One Migrator covers every table of the library: the lines of the dedup
// table, of each outbox topic and of retry topics' parked keys. Status
// lists each version.
func ExampleNew() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_migrate_new")
	defer cleanup()

	m, err := migrate.New(pool,
		deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema}),
		outbox.MigrationLine(outbox.Config{Schema: schema}, "orders"),
		retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: schema}),
	)
	if err != nil {
		panic(err)
	}
	if _, err := m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 1}); err != nil {
		panic(err)
	}
	st, err := m.Status(ctx)
	if err != nil {
		panic(err)
	}
	for _, s := range st {
		fmt.Printf("%-34s %03d_%-20s applied: %v\n", s.Component, s.Version, s.Name, s.Applied)
	}
	// Output:
	// processed_event:processed_event    001_processed_event      applied: true
	// processed_event:processed_event    002_retention_and_groups applied: false
	// processed_event:processed_event    003_lease                applied: false
	// processed_event:processed_event    004_processed_at_index_non_v7 applied: false
	// processed_event:processed_event    005_progress             applied: false
	// outbox:outbox_orders               001_topic_tables         applied: true
	// outbox:outbox_orders               002_snapshot_position    applied: false
	// outbox:outbox_orders               003_position_cluster     applied: false
	// outbox:outbox_orders               004_dead_rows            applied: false
	// outbox:outbox_orders               005_created_at_utc       applied: false
	// retry_parked_key:retry_parked_key  001_parked_key           applied: true
	// retry_parked_key:retry_parked_key  002_parked_message       applied: false
}

// Up is the start-up call: every pending version of every line, from any
// number of instances at once.
func ExampleUp() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_migrate_up")
	defer cleanup()

	table := deduplicator.TableConfig{Schema: schema}
	for range 2 {
		if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
			panic(err)
		}
	}
	fmt.Println(deduplicator.Check(ctx, pool, table))
	// Output:
	// <nil>
}

// Migrations renders the SQL for goose or golang-migrate without
// connecting: each Up ends by recording its version, so the start-up checks
// accept the tables.
func ExampleMigrator_Migrations() {
	m, err := migrate.New(nil,
		deduplicator.MigrationLine(deduplicator.TableConfig{Schema: "billing"}),
		outbox.MigrationLine(outbox.Config{Schema: "billing"}, "billing.charged"),
	)
	if err != nil {
		panic(err)
	}
	migs, err := m.Migrations()
	if err != nil {
		panic(err)
	}
	for _, mg := range migs {
		fmt.Printf("%s %03d_%s\n", mg.Component, mg.Version, mg.Name)
	}
	// Output:
	// processed_event:processed_event 001_processed_event
	// processed_event:processed_event 002_retention_and_groups
	// processed_event:processed_event 003_lease
	// processed_event:processed_event 004_processed_at_index_non_v7
	// processed_event:processed_event 005_progress
	// outbox:outbox_billing.charged 001_topic_tables
	// outbox:outbox_billing.charged 002_snapshot_position
	// outbox:outbox_billing.charged 003_position_cluster
	// outbox:outbox_billing.charged 004_dead_rows
	// outbox:outbox_billing.charged 005_created_at_utc
}
