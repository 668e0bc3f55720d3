package idemkafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// Cooperative rebalancing is refused on every path Sarama reads: the
// GroupStrategies list, and the deprecated Strategy field, which Sarama
// reads first (issue 30, item 3).
func TestSubscriberRefusesCooperativeOnEveryPath(t *testing.T) {
	for name, mod := range map[string]func(*sarama.Config){
		"GroupStrategies": func(c *sarama.Config) {
			c.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
		},
		"GroupStrategies, second choice": func(c *sarama.Config) {
			c.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyRange(), sarama.NewBalanceStrategyCooperativeSticky()}
		},
		"deprecated Strategy over an eager GroupStrategies": func(c *sarama.Config) {
			c.Consumer.Group.Rebalance.Strategy = sarama.NewBalanceStrategyCooperativeSticky()
		},
	} {
		t.Run(name, func(t *testing.T) {
			sc := sarama.NewConfig()
			sc.Version = sarama.V2_4_0_0
			mod(sc)
			_, err := idemkafka.NewSubscriber(idemkafka.SubscriberConfig{Brokers: []string{"127.0.0.1:1"}, ConsumerGroup: "g", Sarama: sc}, nil)
			require.ErrorContains(t, err, "idemkafka: invalid config: Sarama: Consumer.Group.Rebalance.")
			require.ErrorContains(t, err, "cooperative rebalancing")
		})
	}
	sc := sarama.NewConfig()
	sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategySticky(), sarama.NewBalanceStrategyRoundRobin()}
	_, err := idemkafka.NewSubscriber(idemkafka.SubscriberConfig{Brokers: []string{"127.0.0.1:1"}, ConsumerGroup: "g", Sarama: sc}, nil)
	require.NoError(t, err, "eager strategies pass")
}

// RevokeTimeout leaves room, before the rebalance deadline, for the
// heartbeat that brings the news, the final commit and ReconnectRetrySleep
// (issue 30, item 7); CommitMetadataMaxBytes stays within the brokers'
// offset.metadata.max.bytes, 4096 unless stated (item 4).
func TestSubscriberConfigMargins(t *testing.T) {
	base := func() idemkafka.SubscriberConfig {
		return idemkafka.SubscriberConfig{Brokers: []string{"127.0.0.1:1"}, ConsumerGroup: "g"}
	}
	for _, tc := range []struct {
		name  string
		mod   func(*idemkafka.SubscriberConfig)
		field string // "" when accepted
	}{
		{"RevokeTimeout below Rebalance.Timeout but not by the margin", func(c *idemkafka.SubscriberConfig) { c.RevokeTimeout = 55 * time.Second }, "RevokeTimeout"},
		{"RevokeTimeout within the margin", func(c *idemkafka.SubscriberConfig) { c.RevokeTimeout = 50 * time.Second }, ""},
		{"a long ReconnectRetrySleep eats the margin", func(c *idemkafka.SubscriberConfig) {
			c.RevokeTimeout = 50 * time.Second
			c.ReconnectRetrySleep = 10 * time.Second
		}, "RevokeTimeout"},
		{"CommitMetadataMaxBytes above Kafka's default limit", func(c *idemkafka.SubscriberConfig) { c.CommitMetadataMaxBytes = 4097 }, "CommitMetadataMaxBytes"},
		{"CommitMetadataMaxBytes at Kafka's default limit", func(c *idemkafka.SubscriberConfig) { c.CommitMetadataMaxBytes = 4096 }, ""},
		{"CommitMetadataMaxBytes within a stated limit", func(c *idemkafka.SubscriberConfig) {
			c.CommitMetadataMaxBytes = 8000
			c.BrokerMetadataMaxBytes = 8192
		}, ""},
		{"CommitMetadataMaxBytes above a stated limit", func(c *idemkafka.SubscriberConfig) {
			c.CommitMetadataMaxBytes = 2048
			c.BrokerMetadataMaxBytes = 1024
		}, "CommitMetadataMaxBytes"},
		{"BrokerMetadataMaxBytes negative", func(c *idemkafka.SubscriberConfig) { c.BrokerMetadataMaxBytes = -1 }, "BrokerMetadataMaxBytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			tc.mod(&cfg)
			_, err := idemkafka.NewSubscriber(cfg, nil)
			if tc.field == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, "idemkafka: invalid config: "+tc.field+": ")
		})
	}
}

// A session that ends in a rebalance is followed by a join at once:
// ReconnectRetrySleep is for errors only (issue 30, item 7). The first
// member's ReconnectRetrySleep is longer than the test's deadline.
func TestSubscriberRejoinsAtOnceAfterARebalance(t *testing.T) {
	f := newFixture(t, 2, 2)
	sc := sarama.NewConfig()
	sc.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	sc.Consumer.Group.Rebalance.Timeout = 20 * time.Minute
	cfg := f.config("rejoin")
	cfg.Sarama = sc
	cfg.ReconnectRetrySleep = 10 * time.Minute
	subscribe := func() (*idemkafka.Subscriber, <-chan *message.Message) {
		sub := f.subscriber(t, cfg)
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
		ch, err := sub.Subscribe(ctx, f.topic)
		require.NoError(t, err)
		go func() {
			for m := range ch {
				m.Ack()
			}
		}()
		return sub, ch
	}
	a, _ := subscribe()
	waitFor(t, "the first member's session", func() bool { return len(a.Stats().Partitions) == 2 })
	b, _ := subscribe()
	waitFor(t, "a session for both members", func() bool {
		return a.Stats().Sessions == 2 && b.Stats().Sessions == 1 && len(a.Stats().Partitions) == 1 && len(b.Stats().Partitions) == 1
	})
}
