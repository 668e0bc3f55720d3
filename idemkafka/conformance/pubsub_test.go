package conformance_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// topicCreator creates a topic the first time it is used: the universal
// suite invents topic names, and the broker does not create topics.
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
	message.Subscriber
	c *topicCreator
}

func (s creatingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.c.ensure(topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// TestPubSub runs Watermill's universal Pub/Sub suite against each engine
// (its own publisher and subscriber) on topics of 4 partitions, where the
// suite's keyless messages keep their order only per partition. The topics
// of one partition (order guaranteed) run too unless -short.
func TestPubSub(t *testing.T) {
	if testing.Short() {
		t.Skip("the universal suite takes minutes")
	}
	broker := kafkatest.Start(t)
	forEach(t, func(t *testing.T, e engine) {
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
				// A group is either classic or KIP-848 on one broker: each
				// engine and topic shape gets groups of its own.
				constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
					sub := e.sub(t, broker.Addrs, e.name+"-"+tc.name+"-"+group, subOpts{revokeTimeout: time.Second})
					return creatingPublisher{Publisher: e.pub(t, broker.Addrs), c: creator}, creatingSubscriber{Subscriber: sub, c: creator}
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
	})
}
