package publisher

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// MinKafkaVersion is the lowest protocol version the safe configs accept: the
// idempotent producer needs 0.11, and 2.1 is Sarama's own default.
var MinKafkaVersion = sarama.V2_1_0_0

// SaramaProducerConfig returns base (or sarama.NewConfig() when nil) with the
// settings that make producing safe, overriding whatever base had:
//   - Producer.Idempotent = true, Producer.RequiredAcks = WaitForAll,
//     Net.MaxOpenRequests = 1 (Sarama requires it for idempotence; it also
//     keeps per-partition order across retries);
//   - Producer.Retry.Max = 10 (at least), Producer.Return.Successes = true
//     (the SyncProducer needs it);
//   - Version raised to at least MinKafkaVersion.
//
// Everything else (TLS, SASL, ClientID, timeouts, compression) passes
// through, so set security on base.
func SaramaProducerConfig(base *sarama.Config) *sarama.Config {
	cfg := clone(base)
	cfg.Producer.Idempotent = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Net.MaxOpenRequests = 1
	if cfg.Producer.Retry.Max < 10 {
		cfg.Producer.Retry.Max = 10
	}
	cfg.Producer.Return.Successes = true
	cfg.Producer.Return.Errors = true
	return cfg
}

// SaramaConsumerConfig returns base (or sarama.NewConfig() when nil) set up
// for a dedup consumer:
//   - Consumer.Offsets.Initial = OffsetOldest: a new group starts at the
//     beginning (Watermill's default OffsetNewest would skip what was
//     produced before the group first joined);
//   - Consumer.Offsets.AutoCommit.Enable = true: Sarama periodically commits
//     only the offsets marked after ack, so it never skips an unprocessed
//     message (disabling it commits synchronously per message, ~100 msg/s);
//   - Consumer.Return.Errors = true; Version at least MinKafkaVersion.
func SaramaConsumerConfig(base *sarama.Config) *sarama.Config {
	cfg := clone(base)
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Offsets.AutoCommit.Enable = true
	cfg.Consumer.Return.Errors = true
	return cfg
}

func clone(base *sarama.Config) *sarama.Config {
	var cfg *sarama.Config
	if base == nil {
		cfg = sarama.NewConfig()
	} else {
		c := *base
		cfg = &c
	}
	if !cfg.Version.IsAtLeast(MinKafkaVersion) {
		cfg.Version = MinKafkaVersion
	}
	return cfg
}

// KafkaConfig is what the Kafka helpers need.
type KafkaConfig struct {
	// Brokers to bootstrap from. Required.
	Brokers []string
	// Sarama is the base client config (TLS, SASL, ClientID, version...).
	// Defaults to sarama.NewConfig(). The helpers copy it and override only
	// the delivery-safety settings listed on SaramaProducerConfig and
	// SaramaConsumerConfig.
	Sarama *sarama.Config
}

// NewKafkaSubscriberConfig returns a watermill-kafka SubscriberConfig for a
// dedup consumer in consumerGroup (required: without a group Sarama reads
// every partition from the start on each run and commits nothing).
func NewKafkaSubscriberConfig(cfg KafkaConfig, consumerGroup string) (kafka.SubscriberConfig, error) {
	if len(cfg.Brokers) == 0 {
		return kafka.SubscriberConfig{}, errors.New("invalid config: Brokers: required")
	}
	if consumerGroup == "" {
		return kafka.SubscriberConfig{}, errors.New("invalid config: consumerGroup: required")
	}
	sc := SaramaConsumerConfig(cfg.Sarama)
	if err := sc.Validate(); err != nil {
		return kafka.SubscriberConfig{}, fmt.Errorf("invalid config: Sarama: %w", err)
	}
	return kafka.SubscriberConfig{
		Brokers:               cfg.Brokers,
		Unmarshaler:           Marshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         consumerGroup,
	}, nil
}

// NewKafkaPublisherConfig returns a watermill-kafka PublisherConfig with the
// safe producer settings and a [Marshaler] that keys records by the
// partition_key metadata.
func NewKafkaPublisherConfig(cfg KafkaConfig) (kafka.PublisherConfig, error) {
	if len(cfg.Brokers) == 0 {
		return kafka.PublisherConfig{}, errors.New("invalid config: Brokers: required")
	}
	pc := SaramaProducerConfig(cfg.Sarama)
	if err := pc.Validate(); err != nil {
		return kafka.PublisherConfig{}, fmt.Errorf("invalid config: Sarama: %w", err)
	}
	return kafka.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             Marshaler{},
		OverwriteSaramaConfig: pc,
	}, nil
}

// Marshaler is watermill-kafka's DefaultMarshaler (metadata as headers) plus
// the record key taken from the partition_key metadata. A message without
// partition_key gets no key (Sarama then spreads such messages over
// partitions, with no order between them).
type Marshaler struct{ kafka.DefaultMarshaler }

var _ kafka.MarshalerUnmarshaler = Marshaler{}

// Marshal implements kafka.Marshaler.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.DefaultMarshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	if key := msg.Metadata.Get(MetadataPartitionKey); key != "" {
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, nil
}
