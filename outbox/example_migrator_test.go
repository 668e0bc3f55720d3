package outbox_test

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// A Migrator creates each topic's messages and offsets tables as a
// versioned component of its own and says what it applied; Validate lists
// what is pending, for a start-up that must not migrate itself.
func ExampleMigrator_Migrate() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_outbox_migrator")
	defer cleanup()

	cfg := outbox.Config{Schema: schema, Topics: []string{"orders", "payments"}}
	migrator, err := outbox.NewMigrator(pool, cfg)
	if err != nil {
		panic(err)
	}
	v, err := migrator.Validate(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending:", len(v.Pending))

	res, err := migrator.Migrate(ctx, deduplicator.DirectionUp, nil)
	if err != nil {
		panic(err)
	}
	for _, v := range res.Versions {
		fmt.Printf("%s: applied %03d_%s\n", v.Component, v.Version, v.Name)
	}
	v, _ = migrator.Validate(ctx)
	fmt.Println("ok:", v.OK)

	res, err = migrator.Migrate(ctx, deduplicator.DirectionDown, &deduplicator.MigrateOpts{TargetVersion: -1})
	if err != nil {
		panic(err)
	}
	fmt.Println("reverted:", len(res.Versions))
	// Output:
	// pending: 4
	// outbox:outbox_orders: applied 001_topic_tables
	// outbox:outbox_orders: applied 002_snapshot_position
	// outbox:outbox_payments: applied 001_topic_tables
	// outbox:outbox_payments: applied 002_snapshot_position
	// ok: true
	// reverted: 4
}

// Migrations renders each topic's migrations for goose or golang-migrate;
// every Up records its version the way a Migrator does, so Check and the
// forwarder accept the tables.
func ExampleMigrations() {
	migs, err := outbox.Migrations(outbox.Config{Schema: "billing", Topics: []string{"billing.charged"}})
	if err != nil {
		panic(err)
	}
	for _, m := range migs {
		fmt.Printf("%s %03d_%s\n", m.Component, m.Version, m.Name)
	}
	// Output:
	// outbox:outbox_billing.charged 001_topic_tables
	// outbox:outbox_billing.charged 002_snapshot_position
}
