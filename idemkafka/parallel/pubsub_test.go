package parallel_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// topicCreator creates a topic (partitions partitions) the first time it is
// used: the universal suite invents topic names, and the broker does not
// create topics on first use.
type topicCreator struct {
	addrs      []string
	partitions int32
	mu         sync.Mutex
	done       map[string]bool
}

func (c *topicCreator) ensure(topic string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done[topic] {
		return nil
	}
	if err := kafkatest.CreateTopic(c.addrs, topic, c.partitions); err != nil {
		return err
	}
	c.done[topic] = true
	return nil
}

type creatingPublisher struct {
	message.Publisher
	c *topicCreator
}

func (p creatingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.c.ensure(topic); err != nil {
		return err
	}
	return p.Publisher.Publish(topic, msgs...)
}

type creatingSubscriber struct {
	*parallel.Subscriber
	c *topicCreator
}

func (s creatingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.c.ensure(topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// TestPubSub runs Watermill's universal Pub/Sub suite against the
// Subscriber (with watermill-kafka's publisher) on the broker: on topics of
// 4 partitions, where the suite's messages have no key (so their order
// holds only per partition, as for watermill-kafka's own run), and on
// topics of one partition, where order is guaranteed.
func TestPubSub(t *testing.T) {
	if testing.Short() {
		t.Skip("the universal suite takes minutes")
	}
	broker := kafkatest.Start(t)
	for _, tc := range []struct {
		name       string
		partitions int32
		ordered    bool
	}{
		{"partitions=4", 4, false},
		{"partitions=1", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			creator := &topicCreator{addrs: broker.Addrs, partitions: tc.partitions, done: map[string]bool{}}
			constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
				pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
				require.NoError(t, err)
				pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
				require.NoError(t, err)
				sc := sarama.NewConfig()
				sc.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
				sc.Consumer.Group.Rebalance.Timeout = 3 * time.Second
				sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
					Client:        idemkafka.ClientConfig{Brokers: broker.Addrs, Sarama: sc, RevokeTimeout: time.Second},
					ConsumerGroup: group, NackResendSleep: 10 * time.Millisecond,
					// Heartbeat + RevokeTimeout + 1 s for the commit + this
					// stay below the 3 s rebalance timeout.
					ReconnectRetrySleep: 100 * time.Millisecond,
				}, watermill.NopLogger{})
				require.NoError(t, err)
				// Some of the suite's tests never close what they subscribed.
				t.Cleanup(func() { _ = sub.Close() })
				return creatingPublisher{Publisher: pub, c: creator}, creatingSubscriber{Subscriber: sub, c: creator}
			}
			tests.TestPubSub(t, tests.Features{
				ConsumerGroups:      true,
				ExactlyOnceDelivery: false,
				GuaranteedOrder:     tc.ordered,
				Persistent:          true,
				ForceShort:          true,
			}, func(t *testing.T) (message.Publisher, message.Subscriber) {
				return constructor(t, "test")
			}, constructor)
		})
	}
}
