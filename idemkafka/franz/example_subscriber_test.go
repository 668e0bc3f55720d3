package franz_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A key's messages come in order; other keys may pass them.
func ExampleNewSubscriber() {
	cluster, _ := kafkatest.NewFake()
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	_ = kafkatest.CreateTopic(brokers, "orders", 1)

	pub, _ := franz.NewPublisher(franz.PublisherConfig{Brokers: brokers}, nil)
	defer pub.Close()
	for _, p := range []string{"a1", "a2", "a3"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(p))
		m.Metadata.Set(publisher.MetadataPartitionKey, "a")
		_ = pub.Publish("orders", m)
	}

	sub, err := franz.NewSubscriber(franz.SubscriberConfig{
		Brokers:       brokers,
		ConsumerGroup: "billing",
		GroupProtocol: "consumer", // KIP-848
		MaxInFlight:   8,
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), "orders")
	if err != nil {
		fmt.Println(err)
		return
	}
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
