package parallel_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A key's messages come in order; other keys may pass them.
func ExampleNewSubscriber() {
	cluster, _ := kafkatest.NewFake()
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	_ = kafkatest.CreateTopic(brokers, "orders", 1)

	pc, _ := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
	pub, _ := kafka.NewPublisher(pc, nil)
	defer pub.Close()
	for _, p := range []string{"a1", "a2", "a3"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(p))
		m.Metadata.Set(publisher.MetadataPartitionKey, "a")
		_ = pub.Publish("orders", m)
	}

	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client:        idemkafka.ClientConfig{Brokers: brokers},
		ConsumerGroup: "billing",
		MaxInFlight:   8,
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	ch, _ := sub.Subscribe(context.Background(), "orders")
	for range 3 {
		m := <-ch
		fmt.Println(string(m.Payload))
		m.Ack()
	}
	// Output:
	// a1
	// a2
	// a3
}
