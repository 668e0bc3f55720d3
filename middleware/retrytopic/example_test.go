package retrytopic_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// exampleBroker returns KAFKA_BROKERS, or an in-process broker, and
// topics with a unique suffix (so the example also runs on a real cluster).
func exampleBroker(names ...string) (brokers []string, topics []string, stop func()) {
	stop = func() {}
	if brokers = kafkatest.External(); brokers == nil {
		c, err := kafkatest.NewFake()
		if err != nil {
			panic(err)
		}
		brokers, stop = c.ListenAddrs(), c.Close
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	for _, n := range names {
		t := n + "-" + hex.EncodeToString(rnd[:])
		if err := kafkatest.CreateTopic(brokers, t, 1); err != nil {
			panic(err)
		}
		topics = append(topics, t)
	}
	return brokers, topics, stop
}

// The wiring: one router consumes the main topic and the retry topic (with
// a Kafka consumer group of its own, and HoldingTracer as its Tracer),
// and both handlers run the same chain with the same dedup consumer group.
// A payment provider is down on the first delivery: after the in-process
// retry the event moves to the retry topic, and is applied from there once
// its backoff has passed.
func Example() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "retrytopic_example")
	defer cleanup()
	brokers, topics, stop := exampleBroker("orders", "orders-retry", "orders-poison")
	defer stop()
	orders, ordersRetry, ordersPoison := topics[0], topics[1], topics[2]
	name := map[string]string{orders: "orders", ordersRetry: "orders-retry"}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema})); err != nil {
		panic(err)
	}

	logger := watermill.NopLogger{}
	kc := idemkafka.ClientConfig{Brokers: brokers}
	pubCfg, _ := idemkafka.WatermillPublisherConfig(kc)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	if err != nil {
		panic(err)
	}
	defer pub.Close()

	rt, err := retrytopic.New(retrytopic.Config{
		Publisher:   pub,
		Topics:      []string{ordersRetry},
		PoisonTopic: ordersPoison,
		Backoff:     retrytopic.Backoff{Initial: 100 * time.Millisecond},
	}, logger)
	if err != nil {
		panic(err)
	}
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: deduplicator.TableConfig{Schema: schema}}, logger)
	if err != nil {
		panic(err)
	}
	retry := wmiddleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond,
		ShouldRetry: func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}

	subCfg, _ := idemkafka.WatermillSubscriberConfig(kc, "billing")
	sub, _ := kafka.NewSubscriber(subCfg, logger)
	retrySubCfg, _ := idemkafka.WatermillSubscriberConfig(kc, "billing-retry")
	retrySubCfg.Tracer = retrytopic.HoldingTracer(retrySubCfg.Tracer) // holds each copy until its not-before time
	retrySub, _ := kafka.NewSubscriber(retrySubCfg, logger)

	applied := make(chan struct{})
	charge := func(msg *message.Message) error {
		topic := name[message.SubscribeTopicFromCtx(msg.Context())]
		if topic == "orders" {
			fmt.Println(topic + ": payment provider unavailable")
			return errors.New("payment provider unavailable")
		}
		fmt.Printf("%s (attempt %s): charged\n", topic, msg.Metadata.Get(retrytopic.MetadataAttempt))
		close(applied)
		return nil
	}
	router, _ := message.NewRouter(message.RouterConfig{}, logger)
	router.AddMiddleware(rt.Middleware, retry.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
	router.AddConsumerHandler("charge", orders, sub, charge)
	router.AddConsumerHandler("charge-retry", ordersRetry, retrySub, charge)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	msg := message.NewMessage(uuid.NewString(), []byte(`{"amount":100}`))
	msg.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	if err := pub.Publish(orders, msg); err != nil {
		panic(err)
	}
	<-applied
	for rt.Stats().Recovered == 0 { // the handler returned; the commit follows
		time.Sleep(10 * time.Millisecond)
	}
	_ = router.Close()
	_ = sub.Close()
	_ = retrySub.Close()
	fmt.Printf("retried %d, recovered %d, poisoned %d\n", rt.Stats().Retried, rt.Stats().Recovered, rt.Stats().Poisoned)
	// Output:
	// orders: payment provider unavailable
	// orders: payment provider unavailable
	// orders-retry (attempt 1): charged
	// retried 1, recovered 1, poisoned 0
}

// KeyOrder needs the parked-keys table: its MigrationLine, migrated up,
// creates it (every instance may do it at start-up), and a Migrator renders
// the SQL for other tools.
func ExampleMigrationLine() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "retrytopic_migrate")
	defer cleanup()
	table := retrytopic.ParkedKeysTable{Schema: schema}
	if err := migrate.Up(ctx, pool, retrytopic.MigrationLine(table)); err != nil {
		panic(err)
	}
	var parked int
	err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".retry_parked_key").Scan(&parked)
	fmt.Println(parked, err)
	render, _ := migrate.New(nil, retrytopic.MigrationLine(table))
	migs, _ := render.Migrations()
	for _, m := range migs {
		fmt.Printf("%03d_%s\n", m.Version, m.Name)
	}
	// Output:
	// 0 <nil>
	// 001_parked_key
	// 002_parked_message
}
