package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// OutboxWriter writes messages inside the message's transaction. The outbox
// package's Outbox implements it; the middleware uses it for the messages a
// handler returns, so consuming one event and producing the next commit
// atomically.
type OutboxWriter interface {
	PublishInTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error
}

// defaultStartupTimeout bounds the start-up check of [NewDedup].
const defaultStartupTimeout = 30 * time.Second

// Config configures the dedup middleware.
type Config struct {
	// DB begins one transaction per message: a *pgxpool.Pool (the usual
	// choice), a *pgx.Conn, a pgx.Tx (each message then runs in a
	// savepoint of it), or a *sql.DB opened with pgx's stdlib driver,
	// through [SQLDB] (handlers then get a *sql.Tx: [SQLTxFromContext]).
	// Required. With a pool or a conn, BEGIN and the claim travel in one
	// pipelined round trip; other Beginners, a *sql.DB included, take two.
	// When it also has BeginTx (pool, conn and [SQLDB] do),
	// [Config.TxOptions] is used.
	DB migrate.Beginner

	// ConsumerGroup is the second half of the dedup key (event id, consumer
	// group). Required, never defaulted: use the Kafka consumer group of the
	// subscriber, so two services on the same topic each apply an event once.
	// A name PostgreSQL cannot store (a NUL byte, invalid UTF-8) is refused
	// with an error wrapping deduplicator.ErrInvalidGroupName.
	ConsumerGroup string

	// Table describes the processed_event table: pass the same value to
	// deduplicator.MigrationLine and the Cleaner. Its retention is the one
	// recorded with the table (Table.Retention, when set, must match it).
	// Defaults to public.processed_event, plain layout.
	Table deduplicator.TableConfig

	// EventIDFunc extracts the event id; the middleware then checks it with
	// publisher.ValidateEventID. A custom one should return a
	// *publisher.EventIDError (or an error wrapping one of publisher's
	// sentinels); any other error is wrapped as publisher.ErrInvalidEventID
	// with Source "func", so that the message still goes to the poison
	// queue. Defaults to
	// [publisher.EventIDFromMessage] (metadata "event_id", else the JSON
	// payload field "eventId"; both must agree when both are present).
	EventIDFunc func(msg *message.Message) (uuid.UUID, error)

	// AllowNonV7 accepts valid UUIDs of any version. Defaults to false: a
	// non-v7 id is refused with publisher.ErrNotUUIDv7. Non-v7 ids cannot be
	// checked for staleness and cannot be stored in a partitioned
	// processed_event.
	AllowNonV7 bool

	// TxOptions for the per-message transaction. Defaults to the zero value:
	// the server's default isolation (READ COMMITTED). Under REPEATABLE READ
	// or SERIALIZABLE a concurrent duplicate fails with SQLSTATE 40001; the
	// middleware returns it as an ordinary (retryable) error.
	TxOptions pgx.TxOptions

	// Outbox, when set, receives the messages a handler returns, in the
	// message's transaction, and the router gets none back. Defaults to nil:
	// returned messages go to the router's publisher after COMMIT, which is
	// at-most-once for them: a crash or publish failure between COMMIT and
	// publish loses them, because the redelivered message is a duplicate and
	// its handler does not run again. Set Outbox for consume→produce steps.
	Outbox OutboxWriter

	// SkipProgress turns off the record of the consumer group's Kafka
	// position in <table>_progress that each claim transaction of a message
	// from watermill-kafka's subscriber makes (in the claim's round trip
	// and commit), which lets idemctl's progress command find and rewind a
	// committed Kafka offset ahead of the database after a failover to an
	// asynchronous standby or a point-in-time restore (docs/guarantees.md).
	// The parallel subscriber keeps its position itself
	// (parallel.SubscriberConfig.Progress), so this changes nothing for its
	// messages. Defaults to false.
	SkipProgress bool

	// KafkaGroups names the Kafka consumer groups, besides ConsumerGroup,
	// of the watermill-kafka subscribers (idemkafka.WatermillSubscriberConfig)
	// whose messages this middleware handles: a retry topic's subscriber
	// in a group of its own (middleware/retrytopic). When such a
	// subscriber, or one whose Kafka group is ConsumerGroup, is assigned a
	// partition, the middleware writes the claim's start as the
	// partition's position in <table>_progress if it has none, before the
	// claim's first record is handed out: a partition that consumed
	// records then always has a position in PostgreSQL, also on a standby
	// promoted after a replication cut, where a position first written by
	// a record's own transaction would be missing and the rewind would
	// skip the records processed after the cut (a retry topic's partition
	// often gets its first record late). Nothing with SkipProgress, nor in
	// lease mode (which records no position yet). Defaults to none:
	// ConsumerGroup's own claims only.
	KafkaGroups []string

	// StaleMargin is subtracted from the table's retention when deciding
	// that an event is stale. Defaults to deduplicator.DefaultStaleMargin (1 hour); it
	// must be shorter than the retention.
	StaleMargin time.Duration

	// ProcessStaleEvents processes events older than the retention minus
	// StaleMargin instead of refusing them with deduplicator.ErrStaleEvent, even when
	// their claim may have been cleaned. Defaults to false: such an event is
	// refused, unless the consumer group was first seen less than the
	// retention minus StaleMargin ago (it cannot have lost a claim yet, so
	// a new group drains an old backlog normally).
	ProcessStaleEvents bool

	// ReplayHorizon is how far back this consumer may be replayed (offset
	// reset, DLQ replay). When it exceeds the retention minus StaleMargin,
	// NewDedup logs it at Info level (Watermill's LoggerAdapter has no Warn
	// level) and starts anyway: events replayed from further back will be
	// refused as stale. Defaults to 0 (no check).
	ReplayHorizon time.Duration

	// IdempotencyNamespace is mixed into the keys of named operations
	// ([IdempotencyKey]) in place of the group's name. It is recorded with
	// the group at its first start and kept from then on, also across a
	// rename (idemctl groups rename), so a downstream provider always
	// sees the same key for the same call. Defaults to "": the recorded
	// namespace, which is ConsumerGroup for a new group. A value that
	// differs from the recorded one is refused (ErrNamespaceMismatch).
	IdempotencyNamespace string

	// Mode is how the middleware processes a message: nil is transaction
	// mode (one transaction per message: BEGIN and the claim, the handler
	// on it, COMMIT); a *GroupCommitConfig is group commit (the messages
	// that reach the middleware at the same time share one transaction;
	// needs a DB that runs several at once, a *pgxpool.Pool); a
	// *LeaseConfig is lease mode (the handler runs with no transaction and
	// no connection held, between a short transaction that takes a lease
	// on the event and one that completes it: for handlers that call out;
	// needs a *pgxpool.Pool). One field, so a Config names one mode; for
	// handlers of two kinds, use two middlewares. A nil *GroupCommitConfig
	// or *LeaseConfig is transaction mode too. Defaults to nil: transaction
	// mode.
	Mode Mode

	// Concurrency is the most messages the subscriber hands the middleware
	// at once: idemkafka's parallel Subscriber.MaxInFlight(), or, with
	// watermill-kafka's subscriber (one message per partition), the
	// partitions an instance consumes. When it is set and DB is a pool,
	// NewDedup refuses ([ErrPoolTooSmall]) a pool whose MaxConns cannot give
	// each transaction its connection: Concurrency connections in
	// one-transaction-per-message mode, min(Concurrency,
	// Mode.Concurrency) with group commit, 2 × Mode.Concurrency + 1
	// in lease mode (whatever Concurrency is: handlers hold none). A smaller
	// pool makes the handlers queue for connections. Defaults to 0: not
	// checked.
	Concurrency int

	// TracerProvider makes a consumer span per message (and one per group
	// in group commit): its parent is the span in msg.Context() (the one
	// watermill-kafka's Sarama tracer makes), else the trace context the
	// producer left in the metadata (W3C traceparent, tracestate, baggage);
	// msg.Context() carries it, so the handler's own spans nest under it.
	// Attributes: messaging semantic conventions, idem.event_id,
	// idem.outcome, idem.reject_reason, and a claim event with
	// idem.claim_wait; never payload bytes. Defaults to nil: the global
	// provider (otel.GetTracerProvider), and no span at all while no SDK is
	// installed there.
	TracerProvider trace.TracerProvider

	// TraceMessageKey adds the Kafka record key to the consumer span
	// (messaging.kafka.message.key), next to the partition and offset that
	// are always recorded. The key is the aggregate id, which may be
	// personal data (docs/security.md), so it is opt-in. Defaults to false.
	TraceMessageKey bool

	// StartupTimeout bounds the start-up work of [NewDedup]: checking the
	// table and registering the consumer group. Defaults to 30 s.
	StartupTimeout time.Duration

	// NowFunc returns the current time: the clock of the stale guard, and
	// of its cache of the table's retention (re-read every
	// deduplicator.RetentionRefreshInterval of this clock). Defaults to
	// time.Now.
	NowFunc func() time.Time
}

func (c *Config) setDefaults() {
	if c.EventIDFunc == nil {
		c.EventIDFunc = publisher.EventIDFromMessage
	}
	if c.StartupTimeout == 0 {
		c.StartupTimeout = defaultStartupTimeout
	}
	switch m := c.Mode.(type) { // the caller's value stays as it was
	case *GroupCommitConfig:
		c.Mode = nil
		if m != nil {
			gc := *m
			gc.setDefaults()
			c.Mode = &gc
		}
	case *LeaseConfig:
		c.Mode = nil
		if m != nil {
			lc := *m
			lc.setDefaults()
			c.Mode = &lc
		}
	}
	if c.StaleMargin == 0 {
		c.StaleMargin = deduplicator.DefaultStaleMargin
	}
	if c.NowFunc == nil {
		c.NowFunc = time.Now
	}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy (a Config with only DB and ConsumerGroup set is valid). It does not
// touch the database: [NewDedup] checks the table.
func (c Config) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c Config) validate() error {
	if c.DB == nil {
		return errors.New("DB: required")
	}
	if c.ConsumerGroup == "" {
		return errors.New("ConsumerGroup: required (the dedup key is event id + consumer group; use the Kafka consumer group)")
	}
	if err := deduplicator.ValidateGroupName("ConsumerGroup", c.ConsumerGroup); err != nil {
		return err
	}
	if err := deduplicator.ValidateGroupName("IdempotencyNamespace", c.IdempotencyNamespace); err != nil {
		return err
	}
	if _, ok := c.DB.(dbx.TxBeginner); !ok && c.TxOptions != (pgx.TxOptions{}) {
		return fmt.Errorf("TxOptions: DB (%T) has no BeginTx, so the options would be ignored (a pgx.Tx runs each message in a savepoint of its own transaction)", c.DB)
	}
	if err := c.Table.Validate(); err != nil {
		return fmt.Errorf("Table.%w", err)
	}
	if c.AllowNonV7 && c.Table.Layout == deduplicator.LayoutPartitioned {
		return errors.New("AllowNonV7: not with Table.Layout = LayoutPartitioned (partitions are placed by UUIDv7 time; a non-v7 id would land in the DEFAULT partition and never age out)")
	}
	if c.StaleMargin < 0 {
		return errors.New("StaleMargin: must not be negative")
	}
	if c.Table.Retention != 0 && c.StaleMargin >= c.Table.Retention {
		return fmt.Errorf("StaleMargin: %s must be shorter than Table.Retention (%s)", c.StaleMargin, c.Table.Retention)
	}
	if c.StartupTimeout < 0 {
		return errors.New("StartupTimeout: must not be negative")
	}
	if c.Concurrency < 0 {
		return errors.New("Concurrency: must not be negative")
	}
	if l := c.lease(); l != nil {
		if err := l.validate(); err != nil {
			return err
		}
		if !concurrent(c.DB) {
			return fmt.Errorf("Mode: lease mode needs a *pgxpool.Pool (or a *sql.DB through SQLDB) as DB, not %T: it runs its phases' transactions concurrently, on connections of their own", c.DB)
		}
	}
	if err := c.checkPool(); err != nil {
		return err
	}
	if gc := c.groupCommit(); gc != nil {
		if err := gc.validate(); err != nil {
			return err
		}
		if _, ok := c.DB.(pgx.Tx); ok {
			return errors.New("Mode: group commit's DB is a pgx.Tx, which cannot run concurrent groups (use a *pgxpool.Pool)")
		}
	}
	return nil
}

// checkPool compares a pool's MaxConns with Concurrency.
func (c Config) checkPool() error {
	max := maxConns(c.DB)
	if max == 0 || c.Concurrency == 0 {
		return nil
	}
	need := c.Concurrency
	gc, l := c.groupCommit(), c.lease()
	if gc != nil {
		need = min(need, gc.Concurrency)
	}
	if l != nil {
		need = l.leaseConns()
	}
	switch {
	case max >= need:
		return nil
	case l != nil:
		return fmt.Errorf("Concurrency: the pool has MaxConns %d, lease mode runs up to %d transactions at once (2 × LeaseConfig.Concurrency + 1; give the pool at least %d, or lower LeaseConfig.Concurrency): %w",
			max, need, need, ErrPoolTooSmall)
	case gc != nil:
		return fmt.Errorf("Concurrency: the pool has MaxConns %d, the %d concurrent group transactions need %d connections (give the pool at least %d): %w",
			max, need, need, need, ErrPoolTooSmall)
	default:
		return fmt.Errorf("Concurrency: the pool has MaxConns %d, but up to %d messages run at once, each holding a connection for its transaction (give the pool at least %d, or lower the subscriber's MaxInFlight): %w",
			max, c.Concurrency, need, ErrPoolTooSmall)
	}
}

// Mode is one of the middleware's ways of processing a message, chosen by
// [Config.Mode]: a *[GroupCommitConfig] or a *[LeaseConfig] (nil:
// transaction mode). Only this package's configs are modes.
type Mode interface {
	isMode()
}

func (*GroupCommitConfig) isMode() {}
func (*LeaseConfig) isMode()       {}

// groupCommit returns the group-commit config, nil in another mode.
func (c Config) groupCommit() *GroupCommitConfig {
	gc, _ := c.Mode.(*GroupCommitConfig)
	return gc
}

// lease returns the lease-mode config, nil in another mode.
func (c Config) lease() *LeaseConfig {
	l, _ := c.Mode.(*LeaseConfig)
	return l
}
