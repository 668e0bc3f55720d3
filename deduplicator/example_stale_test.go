package deduplicator_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// CheckStale refuses an event whose claim the Cleaner may have deleted: one
// older than the retention (minus StaleMargin) in a group that is old
// enough to have lost claims. A group first seen today has lost none.
func ExampleDeduplicator_CheckStale() {
	ctx := context.Background()
	pool, schema, cleanup := examplePool(ctx)
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	d, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}
	if _, err := d.Register(ctx, pool, ""); err != nil { // at start-up
		panic(err)
	}
	fresh := publisher.NewEventID()
	fmt.Println("fresh:", d.CheckStale(ctx, pool, fresh, time.Now()))
	// Seen from 30 days ahead, the event is older than the 7-day retention,
	// and so is the group.
	err = d.CheckStale(ctx, pool, fresh, time.Now().AddDate(0, 0, 30))
	fmt.Println("a month later:", errors.Is(err, deduplicator.ErrStaleEvent), strings.Contains(err.Error(), fresh.String()))
	// Output:
	// fresh: <nil>
	// a month later: true true
}
