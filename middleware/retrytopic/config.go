package retrytopic

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Defaults.
const (
	// defaultMaxAttempts is how many times a transient failure is tried
	// again from a retry topic before it is poisoned.
	defaultMaxAttempts = 3
	// defaultInitialDelay is the backoff before the first retry-topic attempt.
	defaultInitialDelay = time.Second
	// defaultMultiplier multiplies the delay from one attempt to the next.
	defaultMultiplier = 2.0
	// defaultMaxDelay caps a delay (before jitter).
	defaultMaxDelay = 5 * time.Minute
	// defaultJitter spreads each delay by ±20 %.
	defaultJitter = 0.2
	// NoJitter, as [Backoff.Jitter], turns the jitter off (0 means the default).
	NoJitter      = -1.0
	defaultSchema = parkedsql.DefaultSchema
	// defaultTable names the parked-keys table of [KeyOrder].
	defaultTable = parkedsql.DefaultTable
	// defaultOverdueAfter is [KeyOrder.OverdueAfter].
	defaultOverdueAfter = 2 * time.Minute
)

// Backoff is the delay before each retry-topic attempt: Initial ×
// Multiplier^(attempt−1), at most Max, then spread uniformly over
// [d·(1−Jitter), d·(1+Jitter)] so that a burst of failures (a downstream
// outage) does not come back all at once. The zero value is the default:
// 1 s, 2 s, 4 s … up to 5 min, ±20 %.
type Backoff struct {
	// Initial is the delay before attempt 1. Defaults to 1 s.
	Initial time.Duration
	// Multiplier is applied from one attempt to the next; at least 1.
	// Defaults to 2.
	Multiplier float64
	// Max caps the delay before jitter. Defaults to 5 min.
	Max time.Duration
	// Jitter is the relative spread, between 0 and 1, or [NoJitter].
	// Defaults to 0.2.
	Jitter float64
}

func (b *Backoff) setDefaults() {
	if b.Initial == 0 {
		b.Initial = defaultInitialDelay
	}
	if b.Multiplier == 0 {
		b.Multiplier = defaultMultiplier
	}
	if b.Max == 0 {
		b.Max = defaultMaxDelay
	}
	if b.Jitter == 0 {
		b.Jitter = defaultJitter
	}
}

func (b Backoff) validate() error {
	switch {
	case b.Initial < 0:
		return errors.New("Backoff.Initial: must not be negative")
	case b.Multiplier < 1 || math.IsInf(b.Multiplier, 0) || math.IsNaN(b.Multiplier):
		return fmt.Errorf("Backoff.Multiplier: %v must be at least 1", b.Multiplier)
	case b.Max < b.Initial:
		return fmt.Errorf("Backoff.Max: %s must not be shorter than Backoff.Initial (%s)", b.Max, b.Initial)
	case b.Jitter != NoJitter && (b.Jitter < 0 || b.Jitter > 1 || math.IsNaN(b.Jitter)):
		return fmt.Errorf("Backoff.Jitter: %v must be between 0 and 1, or NoJitter", b.Jitter)
	}
	return nil
}

// randomDelay returns the delay before retry-topic attempt (1 for the
// first), with the defaults applied and a random jitter.
func (b Backoff) randomDelay(attempt int) time.Duration {
	b.setDefaults()
	return b.delay(attempt, rand.Float64())
}

// delay is randomDelay with the random number r in [0, 1) given.
func (b Backoff) delay(attempt int, r float64) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	d := float64(b.Initial) * math.Pow(b.Multiplier, float64(attempt-1))
	if d > float64(b.Max) || math.IsInf(d, 0) {
		d = float64(b.Max)
	}
	if b.Jitter > 0 {
		d *= 1 + b.Jitter*(2*r-1)
	}
	return time.Duration(d)
}

// Config configures a [RetryTopic].
type Config struct {
	// Publisher publishes the retry-topic copies and the poisoned messages.
	// Required. Use a Kafka publisher whose marshaler keys records by the
	// partition_key metadata (idemkafka.WatermillPublisherConfig), so that a
	// copy lands in one partition with the other events of its key.
	Publisher message.Publisher

	// Topics are the retry topics. Attempt n goes to Topics[n−1]; the last
	// topic takes every attempt beyond len(Topics). One topic is the
	// simplest set-up; one topic per attempt (Spring Kafka's default) keeps
	// the delays within a topic alike, so a copy waiting long never holds a
	// copy due sooner behind it in its partition. Required. Subscribe to
	// each with a Kafka consumer group of its own (not the main topic's),
	// with [HoldingTracer] as its Tracer. Retry topics belong to one dedup
	// consumer group: another service (another idem.Config.ConsumerGroup)
	// that consumes the same main topic needs retry topics of its own, or
	// its retry consumers run this group's copies, ahead of the events
	// before them in its own stream.
	Topics []string

	// PoisonTopic receives the messages whose attempts ran out and those
	// that failed with a permanent error, with watermill's poison metadata
	// (reason_poisoned, topic_poisoned = the original topic,
	// handler_poisoned, subscriber_poisoned). Required.
	PoisonTopic string

	// MaxAttempts is how many retry-topic attempts follow the first
	// processing (after the in-process Retry of each). Defaults to
	// 3.
	MaxAttempts int

	// Backoff sets the delay before each attempt. Defaults to the zero
	// [Backoff]: 1 s, 2 s, 4 s … up to 5 min, ±20 %.
	Backoff Backoff

	// IsPermanentFunc tells errors that no retry can fix: those are
	// poisoned at once. Defaults to idem.IsPermanent.
	IsPermanentFunc func(error) bool

	// KeyOrder, when set, keeps the order of the events of a key: while a
	// key has an event on the retry path, its later events wait for it in
	// PostgreSQL instead of overtaking it. Defaults to nil: a retried event is
	// overtaken by the later events of its key, which keep flowing. It
	// needs the key's events in order: a message of an parallel.Subscriber
	// with OrderNone is refused ([ErrKeyOrderUnordered], nacked).
	KeyOrder *KeyOrder

	// StartupTimeout bounds the start-up work of [New]: with KeyOrder, the
	// check that the parked-keys table is migrated and that the outbox has
	// the hand-off topic's table. Defaults to 30 s.
	StartupTimeout time.Duration

	// NowFunc returns the current time. Defaults to time.Now.
	NowFunc func() time.Time
}

// defaultStartupTimeout bounds the start-up check of [New], as
// idem.Config.StartupTimeout's default bounds idem.NewDedup's.
const defaultStartupTimeout = 30 * time.Second

// KeyOrder configures the per-key order of [Config.KeyOrder]. The keys with
// an event on the retry path ("parked") are recorded in a PostgreSQL table
// (create it with [MigrationLine]), with the messages of the events waiting
// behind each key's first one: payloads and metadata are stored in
// PostgreSQL until those events are released.
type KeyOrder struct {
	// DB records and looks up the parked keys: a *pgxpool.Pool (the usual
	// choice), a *pgx.Conn or a pgx.Tx. Required.
	DB migrate.Beginner
	// Outbox writes, in the transaction that releases a key's event, the
	// key's next parked event to the first retry topic (Config.Topics[0]),
	// due at once: an *outbox.Outbox whose tables include that topic, with
	// an outbox.Forwarder forwarding it. [New] checks the topic's table
	// when the writer can (*outbox.Outbox does). Required.
	Outbox idem.OutboxWriter
	// ConsumerGroup is the dedup consumer group: the same value as
	// idem.Config.ConsumerGroup of the main and the retry handlers.
	// Required.
	ConsumerGroup string
	// Table is the parked-keys table. Defaults to public.retry_parked_key.
	Table ParkedKeysTable
	// KeyFunc returns the key whose order is kept; "" means the message
	// has none and is never held back. Defaults to the
	// partition_key metadata, else the Kafka record key.
	KeyFunc func(msg *message.Message) string
	// EventIDFunc reads the event id. Defaults to publisher.EventIDFromMessage;
	// use the same as idem.Config.EventIDFunc.
	EventIDFunc func(msg *message.Message) (uuid.UUID, error)
	// OverdueAfter is how long past its not-before time a key's first
	// event's copy may stay away before the key counts as stalled: the
	// copy is not coming back (no retry consumer runs, its consumer group
	// cannot rebalance, the topic's retention dropped it), and the key's
	// later events wait behind it. [RetryTopic.Middleware] checks at most
	// every OverdueAfter/4 (at least 5 s apart, on a message's way
	// through), reports the count in Stats.OverdueKeys and logs one line
	// naming the most overdue key and the recovery (`idemctl retry
	// unblock`, [Unblock]). -1 turns the check off. Defaults to 2 minutes.
	OverdueAfter time.Duration
}

// ParkedKeysTable names the parked-keys table. The zero value is
// public.retry_parked_key.
type ParkedKeysTable struct {
	// Schema holding the table. Defaults to "public".
	Schema string
	// Table name. Defaults to "retry_parked_key".
	Table string
}

func (t *ParkedKeysTable) setDefaults() {
	if t.Schema == "" {
		t.Schema = defaultSchema
	}
	if t.Table == "" {
		t.Table = defaultTable
	}
}

func (t ParkedKeysTable) validate() error {
	if err := ident.Validate("Schema", t.Schema); err != nil {
		return err
	}
	if err := ident.Validate("Table", t.Table); err != nil {
		return err
	}
	if len(t.Table) > 63-len("_order_idx") {
		return fmt.Errorf("Table: %q is too long for its index name (%s_order_idx)", t.Table, t.Table)
	}
	return nil
}

func (c *Config) setDefaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = defaultMaxAttempts
	}
	c.Backoff.setDefaults()
	if c.IsPermanentFunc == nil {
		c.IsPermanentFunc = idem.IsPermanent
	}
	if c.NowFunc == nil {
		c.NowFunc = time.Now
	}
	if c.StartupTimeout == 0 {
		c.StartupTimeout = defaultStartupTimeout
	}
	if c.KeyOrder != nil {
		ko := *c.KeyOrder // the caller's value stays as it was
		ko.Table.setDefaults()
		if ko.KeyFunc == nil {
			ko.KeyFunc = defaultKeyFunc
		}
		if ko.EventIDFunc == nil {
			ko.EventIDFunc = publisher.EventIDFromMessage
		}
		if ko.OverdueAfter == 0 {
			ko.OverdueAfter = defaultOverdueAfter
		}
		c.KeyOrder = &ko
	}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy. It does not touch the broker or the database.
func (c Config) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c Config) validate() error {
	if c.Publisher == nil {
		return errors.New("Publisher: required")
	}
	if len(c.Topics) == 0 {
		return errors.New("Topics: at least one retry topic is required")
	}
	for i, t := range c.Topics {
		if t == "" {
			return fmt.Errorf("Topics[%d]: must not be empty", i)
		}
		if t == c.PoisonTopic {
			return fmt.Errorf("Topics[%d]: %q is also the PoisonTopic", i, t)
		}
	}
	if c.PoisonTopic == "" {
		return errors.New("PoisonTopic: required (where the messages go whose attempts ran out)")
	}
	if c.MaxAttempts < 1 {
		return fmt.Errorf("MaxAttempts: %d must be at least 1", c.MaxAttempts)
	}
	if err := c.Backoff.validate(); err != nil {
		return err
	}
	if c.StartupTimeout < 0 {
		return errors.New("StartupTimeout: must not be negative")
	}
	if ko := c.KeyOrder; ko != nil {
		if ko.DB == nil {
			return errors.New("KeyOrder.DB: required")
		}
		if ko.Outbox == nil {
			return errors.New("KeyOrder.Outbox: required (the outbox that writes a key's next event to Topics[0] when the event before it is released)")
		}
		if ko.ConsumerGroup == "" {
			return errors.New("KeyOrder.ConsumerGroup: required (the dedup consumer group, idem.Config.ConsumerGroup)")
		}
		if err := deduplicator.ValidateGroupName("KeyOrder.ConsumerGroup", ko.ConsumerGroup); err != nil {
			return err
		}
		if err := ko.Table.validate(); err != nil {
			return fmt.Errorf("KeyOrder.Table.%w", err)
		}
		if ko.OverdueAfter < -1 {
			return errors.New("KeyOrder.OverdueAfter: must be positive, or -1 for no check")
		}
	}
	return nil
}

// topic returns the retry topic of attempt n (1 for the first).
func (c Config) topic(n int) string {
	if n < 1 {
		n = 1
	}
	if n > len(c.Topics) {
		n = len(c.Topics)
	}
	return c.Topics[n-1]
}
