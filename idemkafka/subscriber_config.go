package idemkafka

import (
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
)

// Ordering says which earlier messages a message waits for before the
// [Subscriber] hands it out.
type Ordering int

const (
	// OrderKey (the default): a message waits only for the earlier
	// messages of its partition with the same record key. Records without
	// a key (nil or empty) are one key of their own per partition: they
	// keep their order among themselves, and keyed records pass them.
	OrderKey Ordering = iota
	// OrderPartition: a message waits for every earlier message of its
	// partition, one in flight per partition (watermill-kafka's order).
	OrderPartition
	// OrderNone: messages are handed out as they are fetched, in any
	// number up to MaxInFlight; nothing is ordered.
	OrderNone
)

func (o Ordering) String() string {
	switch o {
	case OrderKey:
		return "key"
	case OrderPartition:
		return "partition"
	case OrderNone:
		return "none"
	}
	return fmt.Sprintf("Ordering(%d)", int(o))
}

// Defaults of [SubscriberConfig].
const (
	// defaultMaxInFlight is how many messages an instance hands out at once.
	defaultMaxInFlight = 64
	// defaultPartitionWindow is how many records a partition holds from
	// its committed offset on.
	defaultPartitionWindow = 1024
	// defaultNackResendSleep is the wait before a nacked message is handed
	// out again (watermill-kafka's default).
	defaultNackResendSleep = 100 * time.Millisecond
	// defaultRevokeTimeout is how long the messages in flight of a revoked
	// partition get to finish.
	defaultRevokeTimeout = 10 * time.Second
	// defaultReconnectRetrySleep is the wait before joining the group again
	// after an error.
	defaultReconnectRetrySleep = time.Second
	// defaultCommitMetadataMaxBytes bounds the commit metadata that records
	// the done offsets above the committed one (Kafka's
	// offset.metadata.max.bytes defaults to 4096).
	defaultCommitMetadataMaxBytes = 2048
)

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Brokers to bootstrap from. Required.
	Brokers []string
	// ConsumerGroup is the Kafka consumer group. Required.
	ConsumerGroup string
	// Sarama is the base client config (TLS, SASL, ClientID, version...).
	// Defaults to sarama.NewConfig(). The Subscriber applies
	// idemkafka.SaramaConsumerConfig to a copy (OffsetOldest, auto-commit of
	// marked offsets, Net.ReadTimeout above the rebalance timeout), so the
	// timeout rule of consumer groups holds here too. Only eager rebalance
	// strategies (range, round-robin, sticky) are supported.
	Sarama *sarama.Config
	// Unmarshaler turns records into messages. Defaults to
	// Marshaler{} (watermill-kafka's DefaultMarshaler: headers
	// become metadata).
	Unmarshaler kafka.Unmarshaler
	// Ordering is which earlier messages a message waits for. Defaults to
	// [OrderKey].
	Ordering Ordering
	// MaxInFlight is how many messages this Subscriber (all its Subscribe
	// calls together) has handed out and not yet seen acked or nacked. A
	// message counts until its ack or nack even after its partition was
	// revoked, so it also bounds the handlers running at once: with the
	// dedup middleware in one-transaction-per-message mode each holds a
	// database connection (see [Subscriber.MaxInFlight]). Defaults to
	// 64.
	MaxInFlight int
	// PartitionWindow is how many records a partition holds, counted from
	// its committed offset: in flight, waiting for an earlier message of
	// their key, and done above the committed offset. While a partition's
	// window is full the Subscriber stops reading it, so Sarama stops
	// fetching it and memory stays bounded (about partitions ×
	// PartitionWindow records, plus Sarama's Consumer.ChannelBufferSize per
	// partition). Defaults to 1024.
	PartitionWindow int
	// NackResendSleep is how long a nacked message waits before it is
	// handed out again; the later messages of its key wait behind it,
	// other keys keep flowing. Set kafka.NoSleep (-1) for none. Defaults
	// to 100 ms.
	NackResendSleep time.Duration
	// RevokeTimeout is how long the messages in flight of a partition that
	// is revoked (rebalance, Close) get to be acked before its offset is
	// committed and they are abandoned: their message contexts are
	// cancelled, and the partition's next owner gets them again (their
	// claims make that harmless). It must be shorter than
	// Consumer.Group.Rebalance.Timeout. Defaults to
	// 10 s.
	RevokeTimeout time.Duration
	// ReconnectRetrySleep is the wait before joining the group again after
	// the consumer group failed. Defaults to
	// 1 s.
	ReconnectRetrySleep time.Duration
	// NotBeforeFunc, when set, returns the time before which a record must
	// not be handed out (zero for none): the record waits in its
	// partition's window, holding only the later messages of its key
	// (with [OrderKey]); other keys keep flowing and a rebalance drops the
	// wait. retrytopic.RecordNotBefore reads the retry topics' not-before header.
	// Defaults to nil (no wait).
	NotBeforeFunc func(*sarama.ConsumerMessage) time.Time
	// CommitMetadataMaxBytes bounds the offset commit metadata in which
	// the Subscriber records the done offsets above the committed one, so
	// that after a restart or rebalance they are not handed out again (a
	// run-length list; what does not fit runs again, and the claims absorb
	// it). Set -1 to write none. Defaults to
	// 2048.
	CommitMetadataMaxBytes int
}

func (c *SubscriberConfig) setDefaults() {
	if c.Unmarshaler == nil {
		c.Unmarshaler = Marshaler{}
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = defaultMaxInFlight
	}
	if c.PartitionWindow == 0 {
		c.PartitionWindow = defaultPartitionWindow
	}
	if c.NackResendSleep == 0 {
		c.NackResendSleep = defaultNackResendSleep
	}
	if c.RevokeTimeout == 0 {
		c.RevokeTimeout = defaultRevokeTimeout
	}
	if c.ReconnectRetrySleep == 0 {
		c.ReconnectRetrySleep = defaultReconnectRetrySleep
	}
	if c.CommitMetadataMaxBytes == 0 {
		c.CommitMetadataMaxBytes = defaultCommitMetadataMaxBytes
	}
}

// Validate reports the first bad field: its error starts with the field's
// name. It checks the Sarama config after the safe consumer settings are
// applied.
func (c SubscriberConfig) Validate() error {
	bad := func(field, problem string) error { return errors.New(field + ": " + problem) }
	switch {
	case len(c.Brokers) == 0:
		return bad("Brokers", "required")
	case c.ConsumerGroup == "":
		return bad("ConsumerGroup", "required (without a group nothing is committed)")
	case c.Ordering < OrderKey || c.Ordering > OrderNone:
		return bad("Ordering", fmt.Sprintf("unknown value %d", int(c.Ordering)))
	case c.MaxInFlight < 1:
		return bad("MaxInFlight", "must be positive")
	case c.PartitionWindow < 1:
		return bad("PartitionWindow", "must be positive")
	case c.NackResendSleep < 0 && c.NackResendSleep != kafka.NoSleep:
		return bad("NackResendSleep", "must not be negative (kafka.NoSleep for none)")
	case c.RevokeTimeout < 0:
		return bad("RevokeTimeout", "must not be negative")
	case c.ReconnectRetrySleep < 0:
		return bad("ReconnectRetrySleep", "must not be negative")
	case c.CommitMetadataMaxBytes < -1:
		return bad("CommitMetadataMaxBytes", "must be positive, or -1 for none")
	}
	sc := c.saramaConfig()
	if err := sc.Validate(); err != nil {
		return bad("Sarama", err.Error())
	}
	if c.RevokeTimeout >= sc.Consumer.Group.Rebalance.Timeout {
		return bad("RevokeTimeout", fmt.Sprintf("%s must be shorter than Consumer.Group.Rebalance.Timeout (%s): the group waits for a revoked partition's handlers no longer than that",
			c.RevokeTimeout, sc.Consumer.Group.Rebalance.Timeout))
	}
	for _, s := range sc.Consumer.Group.Rebalance.GroupStrategies {
		if s != nil && s.Name() == sarama.CooperativeStickyBalanceStrategyName {
			return bad("Sarama", "Consumer.Group.Rebalance.GroupStrategies: cooperative rebalancing is not supported (use range, round-robin or sticky)")
		}
	}
	return nil
}

// saramaConfig is the base with the safe consumer settings.
func (c SubscriberConfig) saramaConfig() *sarama.Config {
	return SaramaConsumerConfig(c.Sarama)
}
