package heartbeat_test

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/components/heartbeat"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// A service runs its heartbeat beside its router; idemctl serve lists the
// instance and draws its rates from the samples.
func ExampleNew() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_heartbeat")
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table), heartbeat.MigrationLine(schema)); err != nil {
		panic(err)
	}
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: table}, nil)
	if err != nil {
		panic(err)
	}
	hb, err := heartbeat.New(heartbeat.Config{DB: pool, Schema: schema, Dedup: dedup, Instance: "billing-1", Version: "v1.4.2"}, nil)
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- hb.Run(runCtx) }() // the first sample at once, then every 5 s

	var instance, mode, version string
	for range 100 {
		err = pool.QueryRow(ctx, `SELECT instance, mode, version FROM idem_heartbeat`).Scan(&instance, &mode, &version)
		if err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	fmt.Println(instance, mode, version, <-done)
	// Output: billing-1 transaction v1.4.2 <nil>
}
