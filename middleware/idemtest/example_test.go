package idemtest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// exampleTB stands in for the *testing.T your test would pass.
type exampleTB struct{ testing.TB }

func (exampleTB) Helper()                   {}
func (exampleTB) Fatalf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

// exampleDB creates a throw-away schema with the processed_event table and a
// ledger table; drop() removes it.
func exampleDB(ctx context.Context) (pool *pgxpool.Pool, table deduplicator.TableConfig, drop func()) {
	pool, schema, drop := pgtest.ForExample(ctx, "example_idemtest")
	table = deduplicator.TableConfig{Schema: schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (event_id uuid NOT NULL, amount int NOT NULL)`); err != nil {
		panic(err)
	}
	return pool, table, drop
}

// Deliver one event five times (two at a time), rolling the first run back
// after the handler returned, then assert: processed once by "billing", and
// exactly one ledger row.
func ExampleRunWithRedelivery() {
	ctx := context.Background()
	t := exampleTB{} // in a test: t *testing.T
	pool, table, drop := exampleDB(ctx)
	defer drop()

	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: table}, nil)
	if err != nil {
		panic(err)
	}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		tx := idem.MustTxFromContext(msg.Context()) // business writes go in the claim's tx
		id, _ := idem.EventIDFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO ledger VALUES ($1, 10)`, id)
		return nil, err
	}

	id := publisher.NewEventID()
	msg := message.NewMessage(id.String(), []byte(`{"amount":10}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())

	res := idemtest.RunWithRedelivery(ctx, t, dedup, handler, msg,
		&idemtest.RedeliveryOpts{Deliveries: 5, Concurrency: 2, RollbackFirst: true})
	idemtest.RequireProcessed(ctx, t, pool, table, "billing", id)
	idemtest.RequireNotProcessed(ctx, t, pool, table, "shipping", id)

	var rows int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&rows)
	fmt.Printf("deliveries=%d runs=%d committed=%d rolled back=%d duplicates=%d ledger rows=%d\n",
		res.Deliveries, res.HandlerRuns, res.Committed, res.InjectedRollbacks, res.Duplicates, rows)
	// Output:
	// deliveries=7 runs=2 committed=1 rolled back=1 duplicates=5 ledger rows=1
}

// A handler that emits a follow-up event through the outbox: under
// redelivery the outbox still holds exactly one message caused by the event.
func ExampleRequireOutboxMessage() {
	ctx := context.Background()
	t := exampleTB{} // in a test: t *testing.T
	pool, table, drop := exampleDB(ctx)
	defer drop()

	ob, err := outbox.New(outbox.Config{Schema: table.Schema, Topics: []string{"invoices"}}, nil)
	if err != nil {
		panic(err)
	}
	if err := migrate.Up(ctx, pool, outbox.MigrationLine(ob.Config(), "invoices")); err != nil {
		panic(err)
	}
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: table}, nil)
	if err != nil {
		panic(err)
	}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		pub, err := ob.PublisherFromContext(msg.Context()) // bound to the claim's tx
		if err != nil {
			return nil, err
		}
		invoice := message.NewMessage(watermill.NewUUID(), []byte(`{"invoice":1}`))
		invoice.SetContext(msg.Context()) // causation_id = the incoming event id
		return nil, pub.Publish("invoices", invoice)
	}

	id := publisher.NewEventID()
	msg := message.NewMessage(id.String(), []byte(`{"order":1}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	idemtest.RunWithRedelivery(ctx, t, dedup, handler, msg, &idemtest.RedeliveryOpts{Deliveries: 3, RollbackFirst: true})

	got := idemtest.RequireOutboxMessage(ctx, t, pool, ob, "invoices", &idemtest.RequireOutboxOpts{CausationID: id, Count: 1})
	fmt.Println(len(got), string(got[0].Payload))
	// Output:
	// 1 {"invoice":1}
}

// Assert, after running a message through the dedup middleware, that the
// event is recorded as processed by its consumer group and by no other.
func ExampleRequireProcessed() {
	ctx := context.Background()
	t := exampleTB{} // in a test: t *testing.T
	pool, table, drop := exampleDB(ctx)
	defer drop()

	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "shipping", Table: table}, nil)
	if err != nil {
		panic(err)
	}
	id := publisher.NewEventID()
	msg := message.NewMessage(id.String(), []byte(`{}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())

	idemtest.RequireNotProcessed(ctx, t, pool, table, "shipping", id)
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	if _, err := dedup.Middleware(noop)(msg); err != nil {
		panic(err)
	}
	idemtest.RequireProcessed(ctx, t, pool, table, "shipping", id)
	idemtest.RequireNotProcessed(ctx, t, pool, table, "billing", id)
	fmt.Println("processed once by shipping")
	// Output:
	// processed once by shipping
}
