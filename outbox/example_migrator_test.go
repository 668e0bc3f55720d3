package outbox_test

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Each topic's messages and offsets tables are a line of their own: a
// migrate.Migrator over them says what it applied, and Validate lists what
// is pending, for a start-up that must not migrate itself.
func ExampleMigrationLine() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_outbox_migrator")
	defer cleanup()

	cfg := outbox.Config{Schema: schema, Topics: []string{"orders", "payments"}}
	migrator, err := migrate.New(pool, outbox.MigrationLine(cfg, "orders"), outbox.MigrationLine(cfg, "payments"))
	if err != nil {
		panic(err)
	}
	v, err := migrator.Validate(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending:", len(v.Pending))

	res, err := migrator.Migrate(ctx, migrate.DirectionUp, nil)
	if err != nil {
		panic(err)
	}
	for _, v := range res.Versions {
		fmt.Printf("%s: applied %03d_%s\n", v.Component, v.Version, v.Name)
	}
	v, _ = migrator.Validate(ctx)
	fmt.Println("ok:", v.OK)

	res, err = migrator.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: -1})
	if err != nil {
		panic(err)
	}
	fmt.Println("reverted:", len(res.Versions))
	// Output:
	// pending: 10
	// outbox:outbox_orders: applied 001_topic_tables
	// outbox:outbox_orders: applied 002_snapshot_position
	// outbox:outbox_orders: applied 003_position_cluster
	// outbox:outbox_orders: applied 004_dead_rows
	// outbox:outbox_orders: applied 005_created_at_utc
	// outbox:outbox_payments: applied 001_topic_tables
	// outbox:outbox_payments: applied 002_snapshot_position
	// outbox:outbox_payments: applied 003_position_cluster
	// outbox:outbox_payments: applied 004_dead_rows
	// outbox:outbox_payments: applied 005_created_at_utc
	// ok: true
	// reverted: 10
}
