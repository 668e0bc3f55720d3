package idemkafka

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/internal/saramastrategy"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// minKafkaVersion is the lowest protocol version the safe configs accept
// (2.1.0): the idempotent producer needs 0.11, and 2.1 is Sarama's own
// default.
var minKafkaVersion = sarama.V2_1_0_0

// SaramaProducerConfig returns base (or sarama.NewConfig() when nil) with the
// settings that make producing safe, overriding whatever base had:
//   - Producer.Idempotent = true, Producer.RequiredAcks = WaitForAll,
//     Net.MaxOpenRequests = 1 (Sarama requires it for idempotence; it also
//     keeps per-partition order across retries);
//   - Producer.Retry.Max = 10 (at least), Producer.Return.Successes = true
//     (the SyncProducer needs it);
//   - Version raised to at least 2.1.0.
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

// joinGroupTimeoutMargin is how much longer than
// Consumer.Group.Rebalance.Timeout the consumer configs make Net.ReadTimeout.
//
// The coordinator answers a JoinGroup request only when the rebalance
// completes, and it may hold it for up to the group's rebalance timeout
// (waiting for members that do not rejoin, such as a crashed process). Sarama
// waits for any response at most Net.ReadTimeout (IBM/sarama#2820): with
// Sarama's defaults (30 s against 60 s) the member drops the join with an
// "i/o timeout", joins again, and every member doing so can keep the group
// rebalancing forever. The margin covers the coordinator completing the join
// and the network; the Java consumer adds the same 5 s to its JoinGroup
// request timeout (JOIN_GROUP_TIMEOUT_LAPSE).
const joinGroupTimeoutMargin = 5 * time.Second

// defaultRevokeTimeout is ClientConfig.RevokeTimeout's default when the
// rebalance timeout is 40 s or more.
const defaultRevokeTimeout = 10 * time.Second

// minConsumerReadTimeout returns the smallest Net.ReadTimeout that lets a
// member of a group with cfg's rebalance timeout wait out a JoinGroup:
// Consumer.Group.Rebalance.Timeout + [joinGroupTimeoutMargin].
//
// The coordinator holds a join for the largest rebalance timeout among the
// group's members, so members of one group should share one value; when
// raising it in a rolling deployment, the members that still run the old
// value wait only their own ReadTimeout.
func minConsumerReadTimeout(cfg *sarama.Config) time.Duration {
	rt := cfg.Consumer.Group.Rebalance.Timeout
	if rt > math.MaxInt64-joinGroupTimeoutMargin {
		return math.MaxInt64
	}
	return rt + joinGroupTimeoutMargin
}

// SaramaConsumerConfig returns base (or sarama.NewConfig() when nil) set up
// for a dedup consumer:
//   - Consumer.Offsets.Initial = OffsetOldest: a new group starts at the
//     beginning (Watermill's default OffsetNewest would skip what was
//     produced before the group first joined);
//   - Consumer.Offsets.AutoCommit.Enable = true: Sarama periodically commits
//     only the offsets marked after ack, so it never skips an unprocessed
//     message (disabling it commits synchronously per message, ~100 msg/s);
//   - Net.ReadTimeout raised to at least [minConsumerReadTimeout]
//     (Consumer.Group.Rebalance.Timeout + 5 s; 65 s with Sarama's defaults):
//     a shorter one can leave the group rejoining forever after a member
//     crashes (see [joinGroupTimeoutMargin]). A base that set either value
//     itself and broke this rule gets the correction logged on sarama.Logger;
//   - Consumer.Return.Errors = true; Version at least 2.1.0;
//   - Consumer.IsolationLevel = ReadCommitted: records of an aborted Kafka
//     transaction (a page the outbox forwarder's transactional producer
//     could not send whole, see [ClientConfig.TransactionalID]) are never
//     delivered, so a partial send failure cannot put a key's later record
//     before the first copy of an earlier one. On topics without
//     transactions it reads what read_uncommitted reads.
func SaramaConsumerConfig(base *sarama.Config) *sarama.Config {
	cfg, note := consumerConfig(base)
	if note != "" {
		sarama.Logger.Println(note)
	}
	return cfg
}

// consumerConfig is SaramaConsumerConfig, returning the correction to log
// ("" when none or when it only replaced Sarama's defaults).
func consumerConfig(base *sarama.Config) (*sarama.Config, string) {
	cfg := clone(base)
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Offsets.AutoCommit.Enable = true
	cfg.Consumer.Return.Errors = true
	cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	var note string
	if minRead := minConsumerReadTimeout(cfg); cfg.Net.ReadTimeout < minRead {
		def := sarama.NewConfig()
		if cfg.Net.ReadTimeout != def.Net.ReadTimeout || cfg.Consumer.Group.Rebalance.Timeout != def.Consumer.Group.Rebalance.Timeout {
			note = fmt.Sprintf("idemkafka: Net.ReadTimeout raised from %s to %s: it must exceed Consumer.Group.Rebalance.Timeout (%s) by %s, "+
				"or a JoinGroup the coordinator holds for the rebalance times out and the group can keep rebalancing (IBM/sarama#2820); "+
				"to detect a dead broker sooner, lower Consumer.Group.Rebalance.Timeout instead",
				cfg.Net.ReadTimeout, minRead, cfg.Consumer.Group.Rebalance.Timeout, joinGroupTimeoutMargin)
		}
		cfg.Net.ReadTimeout = minRead
	}
	return cfg, note
}

func clone(base *sarama.Config) *sarama.Config {
	var cfg *sarama.Config
	if base == nil {
		cfg = sarama.NewConfig()
	} else {
		c := *base
		cfg = &c
		saramastrategy.Own(cfg) // each copy plans with strategy values of its own
	}
	if !cfg.Version.IsAtLeast(minKafkaVersion) {
		cfg.Version = minKafkaVersion
	}
	return cfg
}

// ClientConfig is what the Kafka helpers need.
type ClientConfig struct {
	// Brokers to bootstrap from. Required.
	Brokers []string
	// Sarama is the base client config (TLS, SASL, ClientID, version...).
	// Defaults to sarama.NewConfig(). The helpers copy it and override only
	// the delivery-safety settings listed on SaramaProducerConfig and
	// SaramaConsumerConfig. Each copy gets new values of Sarama's stateful
	// balance strategies (sticky, cooperative-sticky), so one base may be
	// shared by every subscriber; the parallel subscriber also gives each
	// Subscribe call its own. watermill-kafka's Subscriber does not: give
	// each topic a Subscriber of its own under those strategies.
	Sarama *sarama.Config
	// Logger receives, at info level, the corrections
	// WatermillSubscriberConfig makes to a value the Sarama base set itself
	// (see [SaramaConsumerConfig]), and the partitions a subscriber gave up
	// after RevokeTimeout. Defaults to sarama.Logger for the corrections,
	// none for the rest.
	Logger watermill.LoggerAdapter
	// RevokeTimeout bounds, for the subscribers of
	// [WatermillSubscriberConfig], how long a member keeps a partition
	// after its group session ended (a rebalance, a Close) while the
	// partition's message in flight still runs. The member then rejoins
	// without it; its offset is not committed, so the partition's next
	// owner receives it again (and the dedup claim absorbs it). Without a
	// bound a slow handler, or a message nacked again and again, keeps the
	// whole group rebalancing, with no partition consumed, until the
	// coordinator's rebalance deadline. A member rejoins at most
	// 2 × RevokeTimeout after its session ended (once more for a message
	// left running by an earlier rebalance), so it must be shorter than
	// half the Sarama base's Consumer.Group.Rebalance.Timeout. Defaults to
	// 10 s, or a quarter of that rebalance timeout when it is below 40 s.
	RevokeTimeout time.Duration
	// TransactionalID makes [NewSyncProducer]'s producer transactional,
	// with this transactional.id (Sarama's Producer.Transaction.ID, which
	// it overrides when set). The outbox forwarder then sends each page as
	// one Kafka transaction and aborts it when any record fails, so a
	// partial failure (record A of a key refused while B of the same key
	// is written) leaves nothing a read_committed consumer sees, and the
	// page is sent again whole: A's first copy stays before B's. The
	// consumer configs of this package read committed records only. Give
	// every running producer its own id (instances with one id fence each
	// other: the older one's sends fail), and keep it across restarts of
	// the same instance (a StatefulSet pod's name, say): a restarted
	// producer with the id aborts the transaction its predecessor left
	// open, while a new id leaves it open, and read_committed consumers of
	// its partitions wait behind it, until Sarama's
	// Producer.Transaction.Timeout (1 min by default; lower it towards the
	// forwarder's SendTimeout) lets the coordinator abort it. Defaults to
	// "": the producer is idempotent but
	// not transactional, and a partial failure can put B's first copy
	// before A's (see docs/outbox.md).
	TransactionalID string
	// Progress, for the subscribers of [WatermillSubscriberConfig], keeps
	// the consumer group's position per partition in PostgreSQL, in the
	// claims' table's <table>_progress companion (DESIGN §12): the marks
	// watermill-kafka makes once a message is acked (its transaction
	// committed) are written there every half Consumer.Offsets.AutoCommit.
	// Interval, in one statement, and only then committed to Kafka; and
	// every claimed partition starts from PostgreSQL's position, forward
	// or back. After a failover to an asynchronous standby or a
	// point-in-time restore, the events of the lost transactions are read
	// again instead of being skipped, with no operator step, and the dedup
	// transactions carry no position write of their own (the middleware
	// writes one per message for a subscriber without Progress). A write
	// finding the server on a new timeline ends the session, so that the
	// next one reads the positions of the new history. Not with the
	// cooperative-sticky strategy (a partition it adds mid-session cannot
	// be moved). The parallel subscriber has its own
	// (parallel.SubscriberConfig.Progress). Defaults to nil (Kafka's
	// committed offset only).
	Progress migrate.DBTX
	// ProgressSchema is the schema of the claims' table, as the
	// middleware's deduplicator.TableConfig.Schema. Defaults to "" (public).
	ProgressSchema string
	// ProgressTable is the claims' table, as
	// deduplicator.TableConfig.Table: deduplicator.MigrationLine creates
	// its <table>_progress companion. Defaults to "" (processed_event).
	ProgressTable string
}

// WatermillSubscriberConfig returns a watermill-kafka SubscriberConfig for a
// dedup consumer in consumerGroup (required: without a group Sarama reads
// every partition from the start on each run and commits nothing).
func WatermillSubscriberConfig(cfg ClientConfig, consumerGroup string) (kafka.SubscriberConfig, error) {
	if len(cfg.Brokers) == 0 {
		return kafka.SubscriberConfig{}, errors.New("invalid config: Brokers: required")
	}
	if consumerGroup == "" {
		return kafka.SubscriberConfig{}, errors.New("invalid config: consumerGroup: required")
	}
	sc, note := consumerConfig(cfg.Sarama)
	if note != "" {
		if cfg.Logger != nil {
			cfg.Logger.Info(note, watermill.LogFields{"consumer_group": consumerGroup})
		} else {
			sarama.Logger.Println(note)
		}
	}
	if err := sc.Validate(); err != nil {
		return kafka.SubscriberConfig{}, fmt.Errorf("invalid config: Sarama: %w", err)
	}
	revoke := cfg.RevokeTimeout
	if revoke == 0 {
		revoke = min(defaultRevokeTimeout, sc.Consumer.Group.Rebalance.Timeout/4)
	}
	switch {
	case revoke < 0:
		return kafka.SubscriberConfig{}, errors.New("invalid config: RevokeTimeout: must not be negative")
	case 2*revoke >= sc.Consumer.Group.Rebalance.Timeout:
		return kafka.SubscriberConfig{}, fmt.Errorf("invalid config: RevokeTimeout: %s must be shorter than half Consumer.Group.Rebalance.Timeout (%s)",
			revoke, sc.Consumer.Group.Rebalance.Timeout)
	}
	var keep func() *progressKeeper
	if cfg.Progress != nil {
		for _, gs := range sc.Consumer.Group.Rebalance.GroupStrategies {
			if gs.Name() == sarama.CooperativeStickyBalanceStrategyName {
				return kafka.SubscriberConfig{}, errors.New("invalid config: Progress: not with the cooperative-sticky strategy: a partition it adds mid-session cannot start from PostgreSQL's position")
			}
		}
		interval := max(sc.Consumer.Offsets.AutoCommit.Interval/2, 10*time.Millisecond)
		logger := cfg.Logger
		if logger == nil {
			logger = watermill.NopLogger{}
		}
		keep = func() *progressKeeper { return newProgressKeeper(cfg, consumerGroup, interval, logger) }
	}
	return kafka.SubscriberConfig{
		Brokers:               cfg.Brokers,
		Unmarshaler:           Marshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         consumerGroup,
		// Bounds how long a member keeps a revoked partition (see
		// ClientConfig.RevokeTimeout). Wrap it, do not replace it, to add
		// a tracer of your own; watermill-kafka's OTELEnabled does not
		// apply over it (the library's own spans: docs/observability.md).
		Tracer: revokeBound(nil, consumerGroup, revoke, cfg.Logger, keep),
	}, nil
}

// WatermillPublisherConfig returns a watermill-kafka PublisherConfig with the
// safe producer settings and a [Marshaler] that keys records by the
// partition_key metadata.
func WatermillPublisherConfig(cfg ClientConfig) (kafka.PublisherConfig, error) {
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
	if key := msg.Metadata.Get(publisher.MetadataPartitionKey); key != "" {
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, nil
}

// NewSyncProducer returns a Sarama SyncProducer with the settings of
// [SaramaProducerConfig], for outbox.ForwarderConfig.Producer.
func NewSyncProducer(cfg ClientConfig) (sarama.SyncProducer, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("invalid config: Brokers: required")
	}
	sc := SaramaProducerConfig(cfg.Sarama)
	if cfg.TransactionalID != "" {
		sc.Producer.Transaction.ID = cfg.TransactionalID
	}
	return sarama.NewSyncProducer(cfg.Brokers, sc)
}
