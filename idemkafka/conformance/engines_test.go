package conformance_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// subOpts are the settings a check gives a subscriber, whatever its engine.
type subOpts struct {
	maxInFlight   int
	window        int
	revokeTimeout time.Duration
}

// engine builds the subscribers and publishers of one Kafka engine.
type engine struct {
	name string
	sub  func(t *testing.T, brokers []string, group string, o subOpts) message.Subscriber
	pub  func(t *testing.T, brokers []string) message.Publisher
}

// closeSub closes sub when the test ends (some of the universal suite's
// tests never close what they subscribed).
func closeSub(t *testing.T, sub message.Subscriber) message.Subscriber {
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func saramaEngine() engine {
	return engine{
		name: "sarama",
		sub: func(t *testing.T, brokers []string, group string, o subOpts) message.Subscriber {
			sc := sarama.NewConfig()
			sc.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
			sc.Consumer.Group.Rebalance.Timeout = 3 * time.Second
			sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
				Client:        idemkafka.ClientConfig{Brokers: brokers, Sarama: sc, RevokeTimeout: o.revokeTimeout},
				ConsumerGroup: group, NackResendSleep: 10 * time.Millisecond,
				MaxInFlight: o.maxInFlight, PartitionWindow: o.window,
				ReconnectRetrySleep: 100 * time.Millisecond,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			return closeSub(t, sub)
		},
		pub: func(t *testing.T, brokers []string) message.Publisher {
			pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
			require.NoError(t, err)
			pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return pub
		},
	}
}

func franzEngine(name string, protocol string) engine {
	return engine{
		name: name,
		sub: func(t *testing.T, brokers []string, group string, o subOpts) message.Subscriber {
			sub, err := franz.NewSubscriber(franz.SubscriberConfig{
				Brokers: brokers, ConsumerGroup: group, GroupProtocol: protocol,
				NackResendSleep: 10 * time.Millisecond, RevokeTimeout: o.revokeTimeout,
				MaxInFlight: o.maxInFlight, PartitionWindow: o.window,
				CommitInterval: 100 * time.Millisecond,
				ClientOpts: []kgo.Opt{
					kgo.SessionTimeout(6 * time.Second), kgo.HeartbeatInterval(300 * time.Millisecond),
					kgo.RebalanceTimeout(3 * time.Second), kgo.FetchMaxWait(200 * time.Millisecond),
				},
			}, watermill.NopLogger{})
			require.NoError(t, err)
			return closeSub(t, sub)
		},
		pub: func(t *testing.T, brokers []string) message.Publisher {
			pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: brokers}, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return pub
		},
	}
}

// engines are every engine the suite runs against.
func engines() []engine {
	return []engine{
		saramaEngine(),
		franzEngine("franz-classic", "classic"),
		franzEngine("franz-kip848", "consumer"),
	}
}

// forEach runs check once per engine, in parallel. On a real cluster
// (KAFKA_BROKERS) the KIP-848 engine runs only when KAFKA_KIP848 says the
// cluster speaks it (Kafka 4.0+).
func forEach(t *testing.T, check func(t *testing.T, e engine)) {
	for _, e := range engines() {
		t.Run(e.name, func(t *testing.T) {
			if e.name == "franz-kip848" && kafkatest.External() != nil && os.Getenv("KAFKA_KIP848") == "" {
				t.Skip("KAFKA_BROKERS is set: set KAFKA_KIP848=1 too when the cluster is Kafka 4.0+")
			}
			t.Parallel()
			check(t, e)
		})
	}
}

// wait polls cond until it holds or the test's patience ends.
func wait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting: %s", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
