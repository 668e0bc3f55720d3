package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// dedupExampleDB creates a throwaway schema holding processed_event and a
// ledger table, and returns a pool whose search_path is that schema, the
// schema's name, and a cleanup that drops it.
func dedupExampleDB(ctx context.Context) (*pgxpool.Pool, string, func()) {
	pool, schema, drop := pgtest.ForExample(ctx, "example_dedup")
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema})); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE ledger (event_id uuid NOT NULL, amount bigint NOT NULL)"); err != nil {
		panic(err)
	}
	return pool, schema, drop
}

// The handler's writes and the event's claim commit in one transaction; a
// redelivered event is acknowledged without running the handler again.
func ExampleNewDedup() {
	ctx := context.Background()
	pool, schema, cleanup := dedupExampleDB(ctx)
	defer cleanup()

	dedup, err := idem.NewDedup(idem.Config{
		DB:            pool,
		ConsumerGroup: "billing", // the Kafka consumer group
		Table:         deduplicator.TableConfig{Schema: schema},
	}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}

	handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		eventID, _ := idem.EventIDFromContext(ctx)
		_, err := idem.MustTxFromContext(ctx).Exec(ctx,
			"INSERT INTO ledger (event_id, amount) VALUES ($1, 100)", eventID)
		fmt.Println("processed")
		return nil, err
	})

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
	msg.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	if _, err := handler(msg); err != nil {
		panic(err)
	}

	redelivered := msg.Copy() // Kafka delivers the same event again
	if _, err := handler(redelivered); err != nil {
		panic(err)
	}
	var rows int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&rows)
	if rows == 1 {
		fmt.Println("duplicate skipped")
	}
	fmt.Println("ledger rows:", rows)
	// Output:
	// processed
	// duplicate skipped
	// ledger rows: 1
}

// The recommended router wiring: the poison queue first (it catches what
// can never succeed), then Retry (each attempt gets a fresh transaction),
// then the dedup middleware, then the handler. Not run: it needs Kafka.
func ExampleDedup_Middleware() {
	pool, _ := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
	logger := watermill.NewStdLogger(false, false)
	brokers := []string{"localhost:9092"}

	subCfg, _ := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: brokers}, "billing")
	sub, _ := kafka.NewSubscriber(subCfg, logger)
	pubCfg, _ := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
	pub, _ := kafka.NewPublisher(pubCfg, logger)

	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing"}, logger)
	if err != nil {
		panic(err)
	}
	poison, _ := middleware.PoisonQueueWithFilter(pub, "payments.poison", idem.IsPermanent)
	retry := middleware.Retry{
		MaxRetries:      5,
		InitialInterval: 100 * time.Millisecond,
		ShouldRetry:     func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) },
		Logger:          logger,
	}

	router, _ := message.NewRouter(message.RouterConfig{}, logger)
	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware)
	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
		tx := idem.MustTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger (amount) VALUES (100)")
		return err
	})
	_ = router.Run(context.Background())
}

// Business writes go through the transaction the middleware opened; outside
// the middleware there is none.
func ExampleTxFromContext() {
	ctx := context.Background()
	pool, schema, cleanup := dedupExampleDB(ctx)
	defer cleanup()
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: deduplicator.TableConfig{Schema: schema}}, nil)
	if err != nil {
		panic(err)
	}

	handle := func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := idem.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction: handler not wrapped by the dedup middleware")
		}
		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger (event_id, amount) VALUES (gen_random_uuid(), 1)")
		return nil, err
	}

	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	_, err = handle(msg)
	fmt.Println("without the middleware:", err)
	_, err = dedup.Middleware(handle)(msg)
	fmt.Println("with the middleware:", err)
	// Output:
	// without the middleware: no transaction: handler not wrapped by the dedup middleware
	// with the middleware: <nil>
}

// IsPermanent separates messages that can never be processed (poison
// queue) from failures that a retry may fix.
func ExampleIsPermanent() {
	ctx := context.Background()
	pool, schema, cleanup := dedupExampleDB(ctx)
	defer cleanup()
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: deduplicator.TableConfig{Schema: schema}}, nil)
	if err != nil {
		panic(err)
	}
	handler := dedup.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })

	noID := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":1}`))
	_, err = handler(noID)
	fmt.Println(errors.Is(err, publisher.ErrMissingEventID), idem.IsPermanent(err))

	v4 := message.NewMessage(watermill.NewUUID(), nil)
	v4.Metadata.Set(publisher.MetadataEventID, "4f7a3c1e-8b2d-4e6f-9a1b-2c3d4e5f6a7b")
	_, err = handler(v4)
	fmt.Println(errors.Is(err, publisher.ErrNotUUIDv7), idem.IsPermanent(err))

	fmt.Println(idem.IsPermanent(idem.Permanent(errors.New("amount must be positive"))))
	fmt.Println(idem.IsPermanent(fmt.Errorf("decode: %w", idem.ErrMalformedPayload)))
	fmt.Println(idem.IsPermanent(errors.New("connection reset by peer")))
	// Output:
	// true true
	// true true
	// true
	// true
	// false
}
