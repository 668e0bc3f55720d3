package parallel

import (
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/migrate"
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
	// partition get to finish (at most a quarter of the rebalance timeout).
	defaultRevokeTimeout = 10 * time.Second
	// defaultReconnectRetrySleep is the wait before joining the group again
	// after an error.
	defaultReconnectRetrySleep = time.Second
	// defaultCommitMetadataMaxBytes bounds the commit metadata that records
	// the done offsets above the committed one (Kafka's
	// offset.metadata.max.bytes defaults to 4096).
	defaultCommitMetadataMaxBytes = 2048
	// defaultBrokerMetadataMaxBytes is Kafka's default
	// offset.metadata.max.bytes: a commit with longer metadata is refused.
	defaultBrokerMetadataMaxBytes = 4096
	// defaultStallTimeout is how long a key's head record waits without an
	// ack before it is reported stalled.
	defaultStallTimeout = 30 * time.Second
	// revokeCommitAllowance is what the RevokeTimeout check gives the final
	// offset commit of a revoked partition (one round trip to the
	// coordinator) before the member rejoins.
	revokeCommitAllowance = time.Second
)

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Client is the Kafka client: Brokers (required), the Sarama base
	// config (TLS, SASL, ClientID, version...; defaults to
	// sarama.NewConfig()) and RevokeTimeout, as for idemkafka's other
	// helpers. The Subscriber applies idemkafka.SaramaConsumerConfig to a
	// copy of Client.Sarama (OffsetOldest, auto-commit of marked offsets,
	// Net.ReadTimeout above the rebalance timeout), so the timeout rule of
	// consumer groups holds here too. Client.RevokeTimeout is how long the
	// messages in flight of a partition that is revoked (rebalance, Close)
	// get to be acked before its offset is committed and they are
	// abandoned: their message contexts are cancelled, and the partition's
	// next owner gets them again (their claims make that harmless). A
	// member learns of a rebalance at its next heartbeat, then waits
	// RevokeTimeout, commits, and (after an error) sleeps
	// ReconnectRetrySleep before it rejoins, so
	// Consumer.Group.Heartbeat.Interval + RevokeTimeout + 1 s (the final
	// commit) + ReconnectRetrySleep must be shorter than
	// Consumer.Group.Rebalance.Timeout, or the coordinator expels the
	// member and its rejoin starts another rebalance; RevokeTimeout
	// defaults to 10 s, or a quarter of that rebalance timeout when it is
	// below 40 s. Client.Logger is used when NewSubscriber gets no logger;
	// Client.TransactionalID is a producer setting the Subscriber ignores.
	// Eager strategies (range, round-robin, sticky) and cooperative-sticky
	// are supported (Consumer.Group.Rebalance.GroupStrategies; cooperative
	// needs Version 2.4 or later): under cooperative-sticky only the
	// partitions that move are revoked, the others keep running.
	Client idemkafka.ClientConfig
	// ConsumerGroup is the Kafka consumer group. Required.
	ConsumerGroup string
	// Unmarshaler turns records into messages. Defaults to
	// idemkafka.Marshaler{} (watermill-kafka's DefaultMarshaler: headers
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
	// PartitionWindow is how many records a partition holds that are not
	// done: ready, in flight, backing off, held, and waiting for an earlier
	// message of their key. Done records leave the window (the committed
	// offset stays at the first record not done, and the done ones above it
	// are written to the commit metadata as runs), so a key whose head
	// fails or runs long holds the committed offset but not its
	// partition's other keys. When the window is full the waiting records
	// of the blocked key (its head failed, waits for its NotBeforeFunc
	// time, or is slow: see docs/parallel.md) with the most of them are
	// spilled: their payload is dropped and they are read again from
	// Kafka when they become their key's head (at most 64 × PartitionWindow spilled records per
	// partition). While a partition's window is full and nothing more can
	// be spilled the Subscriber pauses its fetching in Sarama (it queues
	// what was fetched already, so that it still sees a revocation), and
	// memory stays bounded (about partitions × PartitionWindow records,
	// plus Sarama's Consumer.ChannelBufferSize and one fetch response per
	// partition). Defaults to 1024.
	PartitionWindow int
	// NackResendSleep is how long a nacked message waits before it is
	// handed out again; the later messages of its key wait behind it,
	// other keys keep flowing. Set kafka.NoSleep (-1) for none. Defaults
	// to 100 ms.
	NackResendSleep time.Duration
	// ReconnectRetrySleep is the wait before joining the group again after
	// the consumer group failed (not after a rebalance, which rejoins at
	// once). Defaults to
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
	// it). Set -1 to write none. It must not exceed
	// BrokerMetadataMaxBytes: the broker refuses a commit with longer
	// metadata, and the committed offset would stop moving. Defaults to
	// 2048.
	CommitMetadataMaxBytes int
	// BrokerMetadataMaxBytes is the brokers' offset.metadata.max.bytes,
	// the bound of CommitMetadataMaxBytes: state it only when the brokers
	// run with a larger value than Kafka's default. A commit the broker
	// refuses anyway is counted in [SubscriberStats].CommitsRefused and
	// logged, and the Subscriber halves the metadata it writes for the
	// topic until commits pass. Defaults to
	// 4096.
	BrokerMetadataMaxBytes int
	// StallTimeout is how long a key's first record not done (its head)
	// may wait without an ack before the key is reported stalled: in
	// [SubscriberStats].Stalls and StalledKeys, in the exported metrics,
	// and in one log line with the key and the cause (failing: nacked,
	// with the last error when [RecordErrors] is in the router; slow: its
	// handler running that long; queued: waiting for a MaxInFlight slot).
	// A partition with a stalled key and no ack for as long shows it in
	// [PartitionStats].StalledFor. Records held by NotBeforeFunc are not
	// stalled. Set -1 to report none. Defaults to 30 s.
	StallTimeout time.Duration
	// Progress, when set, keeps the group's position in PostgreSQL, in
	// the claims' database (a *pgxpool.Pool of the same cluster as the
	// dedup middleware's, or the position would not follow the claims
	// through a failover): each partition's committed offset and the done
	// runs above it, written after the acks they cover (so after their
	// transactions committed), and read when the partition is assigned.
	// PostgreSQL's position wins over Kafka's committed offset (which is
	// still committed, for lag tools): after a failover to an asynchronous
	// standby or a point-in-time restore, the events of the lost
	// transactions are handed out again instead of being skipped
	// (docs/guarantees.md). A write finding the server on a new timeline
	// ends the session, so that the next one reads the positions of the
	// new history. Not with the cooperative-sticky strategy (a partition
	// it adds mid-session cannot be moved). Defaults to nil (Kafka's
	// committed offset only).
	Progress migrate.DBTX
	// ProgressSchema is the schema of the claims' table, as the
	// middleware's deduplicator.TableConfig.Schema. Defaults to "" (public).
	ProgressSchema string
	// ProgressTable is the claims' table, as
	// deduplicator.TableConfig.Table: deduplicator.MigrationLine creates
	// its <table>_progress companion, where Progress is kept. Defaults to
	// "" (processed_event).
	ProgressTable string
}

func (c *SubscriberConfig) setDefaults() {
	if c.Unmarshaler == nil {
		c.Unmarshaler = idemkafka.Marshaler{}
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
	if c.Client.RevokeTimeout == 0 {
		base := c.Client.Sarama
		if base == nil {
			base = sarama.NewConfig()
		}
		c.Client.RevokeTimeout = min(defaultRevokeTimeout, base.Consumer.Group.Rebalance.Timeout/4)
	}
	if c.ReconnectRetrySleep == 0 {
		c.ReconnectRetrySleep = defaultReconnectRetrySleep
	}
	if c.CommitMetadataMaxBytes == 0 {
		c.CommitMetadataMaxBytes = defaultCommitMetadataMaxBytes
	}
	if c.BrokerMetadataMaxBytes == 0 {
		c.BrokerMetadataMaxBytes = defaultBrokerMetadataMaxBytes
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = defaultStallTimeout
	}
}

// Validate reports the first bad field: its error starts with the field's
// name. It checks the Sarama config after the safe consumer settings are
// applied.
func (c SubscriberConfig) Validate() error {
	bad := func(field, problem string) error { return errors.New(field + ": " + problem) }
	switch {
	case len(c.Client.Brokers) == 0:
		return bad("Client.Brokers", "required")
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
	case c.Client.RevokeTimeout < 0:
		return bad("Client.RevokeTimeout", "must not be negative")
	case c.ReconnectRetrySleep < 0:
		return bad("ReconnectRetrySleep", "must not be negative")
	case c.CommitMetadataMaxBytes < -1:
		return bad("CommitMetadataMaxBytes", "must be positive, or -1 for none")
	case c.BrokerMetadataMaxBytes < 0:
		return bad("BrokerMetadataMaxBytes", "must be positive")
	case c.StallTimeout < -1:
		return bad("StallTimeout", "must be positive, or -1 for none")
	case c.CommitMetadataMaxBytes > c.brokerMetadataMaxBytes():
		return bad("CommitMetadataMaxBytes", fmt.Sprintf("%d is above the brokers' offset.metadata.max.bytes (BrokerMetadataMaxBytes: %d): the broker would refuse every commit and the committed offset would freeze",
			c.CommitMetadataMaxBytes, c.brokerMetadataMaxBytes()))
	}
	sc := c.saramaConfig()
	if err := sc.Validate(); err != nil {
		return bad("Client.Sarama", err.Error())
	}
	if c.Progress != nil {
		for _, gs := range sc.Consumer.Group.Rebalance.GroupStrategies {
			if gs.Name() == sarama.CooperativeStickyBalanceStrategyName {
				return bad("Progress", "not with the cooperative-sticky strategy: a partition it adds mid-session cannot start from PostgreSQL's position")
			}
		}
	}
	reconnect := max(c.ReconnectRetrySleep, 0)
	if reconnect == 0 {
		reconnect = defaultReconnectRetrySleep
	}
	if need := sc.Consumer.Group.Heartbeat.Interval + c.Client.RevokeTimeout + revokeCommitAllowance + reconnect; need >= sc.Consumer.Group.Rebalance.Timeout {
		return bad("Client.RevokeTimeout", fmt.Sprintf("%s + Consumer.Group.Heartbeat.Interval (%s) + %s for the final commit + ReconnectRetrySleep (%s) must be shorter than Consumer.Group.Rebalance.Timeout (%s): "+
			"a member learns of a rebalance at its next heartbeat and must rejoin before that deadline, or the coordinator expels it and its rejoin starts another rebalance",
			c.Client.RevokeTimeout, sc.Consumer.Group.Heartbeat.Interval, revokeCommitAllowance, reconnect, sc.Consumer.Group.Rebalance.Timeout))
	}
	return nil
}

// brokerMetadataMaxBytes is BrokerMetadataMaxBytes or its default.
func (c SubscriberConfig) brokerMetadataMaxBytes() int {
	if c.BrokerMetadataMaxBytes == 0 {
		return defaultBrokerMetadataMaxBytes
	}
	return c.BrokerMetadataMaxBytes
}

// saramaConfig is the base with the safe consumer settings.
func (c SubscriberConfig) saramaConfig() *sarama.Config {
	return idemkafka.SaramaConsumerConfig(c.Client.Sarama)
}
