package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Run the forwarder: committed outbox rows go to Kafka with the idempotent
// producer, keyed by partition_key, with the event id in the headers.
func ExampleNewForwarder() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	schema := pgtest.SchemaName("example_forwarder")
	defer pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	brokers := kafkatest.External()
	if brokers == nil {
		cluster, err := kafkatest.NewFake()
		if err != nil {
			panic(err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
	}
	topic := "orders-" + schema[len(schema)-12:]
	if err := kafkatest.CreateTopic(brokers, topic, 1); err != nil {
		panic(err)
	}

	ob, err := outbox.New(outbox.Config{Schema: schema, Topics: []string{topic}}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	if err := migrate.Up(ctx, pool, outbox.MigrationLine(ob.Config(), topic)); err != nil {
		panic(err)
	}
	msg := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"order-42"}`)), "order-42")
	if err := ob.PoolPublisher(pool).Publish(topic, msg); err != nil {
		panic(err)
	}

	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: brokers})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: pool, Outbox: ob, Producer: producer}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	go func() { _ = fwd.Run(ctx) }()
	defer fwd.Close()

	consumer, err := sarama.NewConsumer(brokers, sarama.NewConfig())
	if err != nil {
		panic(err)
	}
	defer consumer.Close()
	pc, err := consumer.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		panic(err)
	}
	defer pc.Close()
	select {
	case rec := <-pc.Messages():
		var eventID string
		for _, h := range rec.Headers {
			if string(h.Key) == publisher.MetadataEventID {
				eventID = string(h.Value)
			}
		}
		_, err := publisher.ParseEventID(eventID)
		fmt.Println("key:", string(rec.Key))
		fmt.Println("event_id header is a UUIDv7:", err == nil)
	case <-time.After(30 * time.Second):
		fmt.Println("timed out")
	}
	// Output:
	// key: order-42
	// event_id header is a UUIDv7: true
}
