package poison_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// exampleTopics returns KAFKA_BROKERS, or an in-process broker, and topics
// with a unique suffix (so the example also runs on a real cluster).
func exampleTopics(names ...string) (brokers []string, topics []string, stop func()) {
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

// A dry run lists the poison messages that match the filter; the replay
// publishes them back to their original topic.
func ExampleReplay() {
	ctx := context.Background()
	brokers, topics, stop := exampleTopics("orders", "orders-poison")
	defer stop()
	orders, ordersPoison := topics[0], topics[1]
	pubCfg, _ := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
	pub, err := kafka.NewPublisher(pubCfg, nil)
	if err != nil {
		panic(err)
	}
	defer pub.Close()

	// What watermill's PoisonQueue left: two refused orders.
	for i, reason := range []string{"permanent: unknown product P-7", "permanent: amount out of range"} {
		m := message.NewMessage(fmt.Sprintf("order-%d", i+1), []byte(`{}`))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reason)
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, orders)
		m.Metadata.Set(wmiddleware.PoisonedHandlerKey, "ledger")
		if err := pub.Publish(ordersPoison, m); err != nil {
			panic(err)
		}
	}

	cfg := poison.Config{
		Kafka:     idemkafka.ClientConfig{Brokers: brokers},
		Topic:     ordersPoison,
		Publisher: pub,
		Filter:    poison.Filter{Reason: "unknown product"},
		DryRun:    true,
	}
	res, err := poison.Replay(ctx, cfg, nil)
	if err != nil {
		panic(err)
	}
	for _, m := range res.Messages {
		fmt.Printf("dry run: %s@%d %s %q replayed=%v\n", m.UUID, m.Offset, m.Handler, m.Reason, m.Replayed)
	}

	cfg.DryRun = false
	res, err = poison.Replay(ctx, cfg, nil)
	if err != nil {
		panic(err)
	}
	fmt.Printf("scanned %d, matched %d, replayed %d\n", res.Scanned, res.Matched, res.Replayed)
	// Output:
	// dry run: order-1@0 ledger "permanent: unknown product P-7" replayed=false
	// scanned 2, matched 1, replayed 1
}
