package outbox_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Publish an event in the same transaction as the business change: if the
// transaction rolls back, the event is gone too; once it commits, the
// Forwarder delivers it to Kafka.
func ExampleOutbox_Publisher() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	schema := pgtest.SchemaName("example_outbox")
	defer pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")

	ob, err := outbox.New(outbox.Config{Schema: schema, Topics: []string{"orders"}}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	if err := migrate.Up(ctx, pool, outbox.MigrationLine(ob.Config(), "orders")); err != nil { // at start-up
		panic(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "orders"}.Sanitize()+" (id text PRIMARY KEY, total int)"); err != nil {
		panic(err)
	}

	// The business transaction.
	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{schema, "orders"}.Sanitize()+" VALUES ('order-42', 1200)"); err != nil {
		panic(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"order-42","total":1200}`))
	publisher.WithPartitionKey(msg, "order-42") // the Kafka record key
	if err := ob.Publisher(tx).Publish("orders", msg); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	var eventID, key string
	if err := pool.QueryRow(ctx, "SELECT metadata->>'event_id', metadata->>'partition_key' FROM "+ob.MessagesTable("orders")).Scan(&eventID, &key); err != nil {
		panic(err)
	}
	id, err := publisher.ParseEventID(eventID)
	fmt.Println("stamped with a UUIDv7:", err == nil && id.String() == msg.Metadata.Get(publisher.MetadataEventID))
	fmt.Println("partition key:", key)
	// Output:
	// stamped with a UUIDv7: true
	// partition key: order-42
}
