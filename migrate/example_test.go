package migrate_test

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// A Migrator says which versions it applied; going down it reverts one
// version unless told a target (-1: every version).
func ExampleMigrator_Migrate() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_migrator")
	defer cleanup()

	migrator, err := migrate.New(pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema}))
	if err != nil {
		panic(err)
	}
	res, err := migrator.Migrate(ctx, migrate.DirectionUp, nil)
	if err != nil {
		panic(err)
	}
	for _, v := range res.Versions {
		fmt.Printf("%s: applied %03d_%s\n", v.Component, v.Version, v.Name)
	}
	res, _ = migrator.Migrate(ctx, migrate.DirectionUp, nil)
	fmt.Println("again:", len(res.Versions), "applied")

	res, err = migrator.Migrate(ctx, migrate.DirectionDown, nil)
	if err != nil {
		panic(err)
	}
	for _, v := range res.Versions {
		fmt.Printf("%s: reverted %03d_%s\n", v.Component, v.Version, v.Name)
	}
	// Output:
	// processed_event:processed_event: applied 001_processed_event
	// processed_event:processed_event: applied 002_retention_and_groups
	// processed_event:processed_event: applied 003_lease
	// processed_event:processed_event: applied 004_processed_at_index_non_v7
	// processed_event:processed_event: applied 005_progress
	// again: 0 applied
	// processed_event:processed_event: reverted 005_progress
}

// Validate lists the versions not recorded as applied: where another
// process (or goose) owns the migrations, a service can refuse to start
// until they ran.
func ExampleMigrator_Validate() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_validate")
	defer cleanup()
	migrator, err := migrate.New(pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema}))
	if err != nil {
		panic(err)
	}

	res, err := migrator.Validate(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("ok:", res.OK)
	for _, m := range res.Pending {
		fmt.Printf("pending: %s %03d_%s\n", m.Component, m.Version, m.Name)
	}

	if _, err := migrator.Migrate(ctx, migrate.DirectionUp, nil); err != nil {
		panic(err)
	}
	res, _ = migrator.Validate(ctx)
	fmt.Println("ok:", res.OK)
	// Output:
	// ok: false
	// pending: processed_event:processed_event 001_processed_event
	// pending: processed_event:processed_event 002_retention_and_groups
	// pending: processed_event:processed_event 003_lease
	// pending: processed_event:processed_event 004_processed_at_index_non_v7
	// pending: processed_event:processed_event 005_progress
	// ok: true
}
