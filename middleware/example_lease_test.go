package middleware_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// In lease mode the handler calls out with no transaction held, and
// registers its write as a statement: the completion sends it with the
// lease's check and the event's claim (and the other completions of its
// batch) in one round trip. A redelivery is a duplicate.
func ExampleCompleteExec() {
	ctx := context.Background()
	pool, schema, cleanup := dedupExampleDB(ctx)
	defer cleanup()
	leased, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: deduplicator.TableConfig{Schema: schema},
		Mode: &idem.LeaseConfig{}}, nil)
	if err != nil {
		panic(err)
	}
	handle := leased.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		// ... the provider call, with idem.NewIdempotencyKeyTransport ...
		id, _ := idem.EventIDFromContext(msg.Context())
		return nil, idem.CompleteExec(msg.Context(), "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)", id, 100)
	})

	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	for range 2 {
		if _, err := handle(msg); err != nil {
			panic(err)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&rows); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", rows)
	// Output:
	// ledger rows: 1
}
