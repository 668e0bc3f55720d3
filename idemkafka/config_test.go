package idemkafka_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// unsafeBase is a user's config with security settings and every delivery
// setting the helpers must override set to the unsafe value.
func unsafeBase() *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = "billing-service"
	c.Version = sarama.V0_11_0_0
	c.Net.TLS.Enable = true
	c.Net.TLS.Config = &tls.Config{ServerName: "kafka.internal", MinVersion: tls.VersionTLS12}
	c.Net.SASL.Enable = true
	c.Net.SASL.Mechanism = sarama.SASLTypePlaintext
	c.Net.SASL.User = "svc"
	c.Net.SASL.Password = "secret"
	c.Producer.Compression = sarama.CompressionSnappy
	c.Producer.Idempotent = false
	c.Producer.RequiredAcks = sarama.NoResponse
	c.Producer.Retry.Max = 0
	c.Producer.Return.Successes = false
	c.Net.MaxOpenRequests = 5
	c.Consumer.Offsets.Initial = sarama.OffsetNewest
	c.Consumer.Offsets.AutoCommit.Enable = false
	c.Consumer.Return.Errors = false
	return c
}

func requireSecurityPreserved(t *testing.T, got, base *sarama.Config) {
	t.Helper()
	require.Equal(t, "billing-service", got.ClientID)
	require.True(t, got.Net.TLS.Enable)
	require.Same(t, base.Net.TLS.Config, got.Net.TLS.Config)
	require.True(t, got.Net.SASL.Enable)
	require.Equal(t, sarama.SASLMechanism(sarama.SASLTypePlaintext), got.Net.SASL.Mechanism)
	require.Equal(t, "svc", got.Net.SASL.User)
	require.Equal(t, "secret", got.Net.SASL.Password)
}

func TestSaramaProducerConfigEnforcesSafeSettings(t *testing.T) {
	t.Parallel()
	base := unsafeBase()
	got := idemkafka.SaramaProducerConfig(base)
	require.NotSame(t, base, got)
	require.True(t, got.Producer.Idempotent)
	require.Equal(t, sarama.WaitForAll, got.Producer.RequiredAcks)
	require.Equal(t, 1, got.Net.MaxOpenRequests)
	require.GreaterOrEqual(t, got.Producer.Retry.Max, 10)
	require.True(t, got.Producer.Return.Successes)
	require.True(t, got.Version.IsAtLeast(sarama.V2_1_0_0))
	require.Equal(t, sarama.CompressionSnappy, got.Producer.Compression)
	requireSecurityPreserved(t, got, base)
	require.NoError(t, got.Validate())

	// The caller's config is not modified.
	require.False(t, base.Producer.Idempotent)
	require.Equal(t, sarama.NoResponse, base.Producer.RequiredAcks)
	require.Equal(t, 5, base.Net.MaxOpenRequests)

	// A newer version and a larger retry budget are kept.
	base.Version = sarama.V3_6_0_0
	base.Producer.Retry.Max = 50
	got = idemkafka.SaramaProducerConfig(base)
	require.Equal(t, sarama.V3_6_0_0, got.Version)
	require.Equal(t, 50, got.Producer.Retry.Max)

	nilBase := idemkafka.SaramaProducerConfig(nil)
	require.True(t, nilBase.Producer.Idempotent)
	require.NoError(t, nilBase.Validate())
}

func TestSaramaConsumerConfigEnforcesSafeSettings(t *testing.T) {
	t.Parallel()
	base := unsafeBase()
	got := idemkafka.SaramaConsumerConfig(base)
	require.Equal(t, sarama.OffsetOldest, got.Consumer.Offsets.Initial)
	require.True(t, got.Consumer.Offsets.AutoCommit.Enable)
	require.True(t, got.Consumer.Return.Errors)
	require.Equal(t, sarama.ReadCommitted, got.Consumer.IsolationLevel, "aborted transactions are never delivered")
	require.True(t, got.Version.IsAtLeast(sarama.V2_1_0_0))
	requireSecurityPreserved(t, got, base)
	require.NoError(t, got.Validate())
	require.Equal(t, sarama.OffsetNewest, base.Consumer.Offsets.Initial, "the caller's config is not modified")
}

// A JoinGroup can be held for the rebalance timeout: the consumer config
// keeps Net.ReadTimeout above it by the join margin (5 s), correcting (and
// logging) a base that breaks the rule, and keeping a base that follows it.
func TestSaramaConsumerConfigReadTimeoutOutlastsRebalance(t *testing.T) {
	t.Parallel()
	def := sarama.NewConfig()
	require.Less(t, def.Net.ReadTimeout, def.Consumer.Group.Rebalance.Timeout, "Sarama's own defaults break the rule")

	withTimeouts := func(read, rebalance time.Duration) *sarama.Config {
		c := sarama.NewConfig()
		c.ClientID = "billing-service"
		if read > 0 {
			c.Net.ReadTimeout = read
		}
		if rebalance > 0 {
			c.Consumer.Group.Rebalance.Timeout = rebalance
		}
		return c
	}
	for _, tc := range []struct {
		name                    string
		base                    *sarama.Config
		wantRead, wantRebalance time.Duration
		wantLogged              bool
	}{
		{"nil base: Sarama's defaults, ReadTimeout raised", nil, 65 * time.Second, 60 * time.Second, false},
		{"untouched Sarama defaults", withTimeouts(0, 0), 65 * time.Second, 60 * time.Second, false},
		{"ReadTimeout lowered by the user", withTimeouts(10*time.Second, 0), 65 * time.Second, 60 * time.Second, true},
		{"Rebalance.Timeout raised by the user", withTimeouts(0, 10*time.Minute), 10*time.Minute + 5*time.Second, 10 * time.Minute, true},
		{"both set, too close", withTimeouts(62*time.Second, 60*time.Second), 65 * time.Second, 60 * time.Second, true},
		{"Rebalance.Timeout lowered below ReadTimeout - margin: kept", withTimeouts(0, 20*time.Second), 30 * time.Second, 20 * time.Second, false},
		{"exactly the margin: kept", withTimeouts(25*time.Second, 20*time.Second), 25 * time.Second, 20 * time.Second, false},
		{"a longer ReadTimeout: kept", withTimeouts(3*time.Minute, 0), 3 * time.Minute, 60 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var before sarama.Config
			if tc.base != nil {
				before = *tc.base
			}
			got := idemkafka.SaramaConsumerConfig(tc.base)
			require.Equal(t, tc.wantRead, got.Net.ReadTimeout)
			require.Equal(t, tc.wantRebalance, got.Consumer.Group.Rebalance.Timeout, "the rebalance timeout is the user's")
			require.GreaterOrEqual(t, got.Net.ReadTimeout, got.Consumer.Group.Rebalance.Timeout+idemkafka.JoinGroupTimeoutMargin)
			require.Equal(t, idemkafka.MinConsumerReadTimeout(got), got.Consumer.Group.Rebalance.Timeout+idemkafka.JoinGroupTimeoutMargin)
			require.NoError(t, got.Validate())
			if tc.base != nil {
				require.Equal(t, before.Net.ReadTimeout, tc.base.Net.ReadTimeout, "the caller's config is not modified")
			}

			logger := watermill.NewCaptureLogger()
			sub, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"k:9092"}, Sarama: tc.base, Logger: logger}, "billing")
			require.NoError(t, err)
			require.Equal(t, tc.wantRead, sub.OverwriteSaramaConfig.Net.ReadTimeout)
			infos := logger.Captured()[watermill.InfoLogLevel]
			if tc.wantLogged {
				require.Len(t, infos, 1)
				require.Contains(t, infos[0].Msg, "Net.ReadTimeout raised from "+tc.base.Net.ReadTimeout.String()+" to "+tc.wantRead.String())
				require.Equal(t, "billing", infos[0].Fields["consumer_group"])
			} else {
				require.Empty(t, infos, "nothing to report: no value the user set was changed")
			}
		})
	}

	huge := sarama.NewConfig()
	huge.Consumer.Group.Rebalance.Timeout = time.Duration(math.MaxInt64)
	require.Equal(t, time.Duration(math.MaxInt64), idemkafka.MinConsumerReadTimeout(huge), "no overflow")
}

func TestWatermillSubscriberConfig(t *testing.T) {
	t.Parallel()
	_, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{}, "g")
	require.ErrorContains(t, err, "Brokers")
	_, err = idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"k:9092"}}, "")
	require.ErrorContains(t, err, "consumerGroup")
	bad := sarama.NewConfig()
	bad.Net.SASL.Enable = true // no user: Sarama refuses it
	_, err = idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"k:9092"}, Sarama: bad}, "g")
	require.ErrorContains(t, err, "invalid config: Sarama")

	base := unsafeBase()
	cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"k:9092"}, Sarama: base}, "billing")
	require.NoError(t, err)
	require.Equal(t, "billing", cfg.ConsumerGroup)
	require.Equal(t, []string{"k:9092"}, cfg.Brokers)
	require.IsType(t, idemkafka.Marshaler{}, cfg.Unmarshaler)
	require.Equal(t, sarama.OffsetOldest, cfg.OverwriteSaramaConfig.Consumer.Offsets.Initial)
	requireSecurityPreserved(t, cfg.OverwriteSaramaConfig, base)
}

func TestWatermillPublisherConfig(t *testing.T) {
	t.Parallel()
	_, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{})
	require.ErrorContains(t, err, "Brokers")

	base := unsafeBase()
	cfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: []string{"k:9092"}, Sarama: base})
	require.NoError(t, err)
	require.IsType(t, idemkafka.Marshaler{}, cfg.Marshaler)
	require.True(t, cfg.OverwriteSaramaConfig.Producer.Idempotent)
	require.Equal(t, sarama.WaitForAll, cfg.OverwriteSaramaConfig.Producer.RequiredAcks)
	requireSecurityPreserved(t, cfg.OverwriteSaramaConfig, base)
}

func TestMarshalerKeysByPartitionKey(t *testing.T) {
	t.Parallel()
	m := message.NewMessage(uuid.NewString(), []byte("p"))
	m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	pm, err := idemkafka.Marshaler{}.Marshal("t", m)
	require.NoError(t, err)
	require.Nil(t, pm.Key, "no partition_key, no record key")

	m.Metadata.Set(publisher.MetadataPartitionKey, "account-42")
	pm, err = idemkafka.Marshaler{}.Marshal("t", m)
	require.NoError(t, err)
	key, err := pm.Key.Encode()
	require.NoError(t, err)
	require.Equal(t, "account-42", string(key))
	var headers []string
	for _, h := range pm.Headers {
		headers = append(headers, string(h.Key))
	}
	require.Contains(t, headers, publisher.MetadataEventID)
}

// Against the broker: a group created after the events were produced still
// reads them (OffsetOldest), and events sharing a partition_key land in one
// partition, in publish order.
func TestKafkaConfigsAgainstBroker(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "accounts", 4)
	logger := watermill.NopLogger{}

	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	require.NoError(t, err)
	defer pub.Close()

	const perKey = 10
	keys := []string{"a", "b", "c", "d", "e", "f"}
	for i := range perKey {
		for _, k := range keys {
			m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
			m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
			m.Metadata.Set(publisher.MetadataPartitionKey, k)
			require.NoError(t, pub.Publish(topic, m))
		}
	}

	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, topic+"-late-group")
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	partitionOf := map[string]map[int32]bool{}
	seq := map[string][]string{}
	for range perKey * len(keys) {
		select {
		case m := <-msgs:
			p, ok := kafka.MessagePartitionFromCtx(m.Context())
			require.True(t, ok)
			k := m.Metadata.Get(publisher.MetadataPartitionKey)
			if partitionOf[k] == nil {
				partitionOf[k] = map[int32]bool{}
			}
			partitionOf[k][p] = true
			seq[k] = append(seq[k], string(m.Payload))
			m.Ack()
		case <-ctx.Done():
			t.Fatal("timed out: the late group did not read the earlier events (OffsetOldest)")
		}
	}
	for _, k := range keys {
		require.Len(t, partitionOf[k], 1, "key %s in one partition", k)
		want := make([]string, perKey)
		for i := range want {
			want[i] = fmt.Sprint(i)
		}
		require.Equal(t, want, seq[k], "key %s in publish order", k)
	}
}
