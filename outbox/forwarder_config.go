package outbox

import (
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
)

// Forwarder defaults.
const (
	// DefaultForwarderName is the forwarder's name: the key of its position
	// row in each topic's offsets table.
	DefaultForwarderName = "outbox_forwarder"
	// defaultBatchSize is how many rows one forwarder transaction reads and
	// sends.
	defaultBatchSize = 1000
	// defaultBatchesPerTransaction is how many batches one forwarder
	// transaction sends before it commits its position.
	defaultBatchesPerTransaction = 4
	// defaultPollInterval is the longest wait between two reads.
	defaultPollInterval = 100 * time.Millisecond
	// defaultRetryInterval is the wait after a failed batch.
	defaultRetryInterval = time.Second
	// defaultShutdownTimeout bounds how long an in-flight batch may take to
	// finish after Close or context cancellation.
	defaultShutdownTimeout = 30 * time.Second
	// defaultStartupCheckTimeout bounds the table check of [NewForwarder].
	defaultStartupCheckTimeout = 10 * time.Second
	// defaultSendTimeout is the longest a send is expected to take.
	defaultSendTimeout = 30 * time.Second
	// idleMargin is how much longer than SendTimeout the server lets a
	// forwarder transaction sit idle.
	idleMargin = 5 * time.Second
	// lockWait is the lock_timeout of a forwarder transaction: how long an
	// instance waits for another's lock on the position before it logs the
	// holder and waits again.
	lockWait = 10 * time.Second
)

// maxNameLen is the width of the offsets table's consumer_group column,
// VARCHAR(255), which holds ForwarderConfig.Name.
const maxNameLen = 255

// ForwarderConfig configures a [Forwarder]. Exactly one of Producer and
// Publisher is required.
type ForwarderConfig struct {
	// DB is the database holding the outbox tables: a pool, since the
	// forwarder runs one transaction per topic at a time, for as long as it
	// runs. Required.
	DB *pgxpool.Pool
	// Outbox names the tables. Required.
	Outbox *Outbox
	// Producer is a Sarama SyncProducer built with
	// idemkafka.SaramaProducerConfig (idempotent, acks=all,
	// MaxOpenRequests=1): each batch goes out in one SendMessages call, in
	// order, keyed by partition_key. This is the fast path; see
	// idemkafka.NewSyncProducer. The forwarder does not close it. One of
	// Producer and Publisher is required.
	Producer sarama.SyncProducer
	// Publisher is any Watermill publisher, e.g. a watermill-kafka publisher
	// built from idemkafka.WatermillPublisherConfig; each batch is one
	// Publish(topic, batch...) call. watermill-kafka sends the messages of
	// one call one at a time, so prefer Producer for Kafka. The forwarder
	// does not close it. One of Producer and Publisher is required.
	Publisher message.Publisher
	// Marshaler turns rows into Kafka records when Producer is used.
	// Defaults to idemkafka.Marshaler (metadata as headers, key =
	// partition_key).
	Marshaler kafka.Marshaler
	// MaxMessageBytes is the largest record, as Sarama counts it against
	// Producer.MaxMessageBytes (ProducerMessage.ByteSize), that a row may
	// make; set it to the producer's. A larger row, and a row whose metadata
	// is unreadable or holds watermill-kafka's reserved UUID key, is never
	// sent: it moves to the topic's dead table with its cause, the later
	// rows of its partition key wait there behind it, and the topic goes on
	// (see docs/outbox.md). Negative: no size check. Defaults to the
	// Outbox's Config.MaxMessageBytes (1 MiB).
	MaxMessageBytes int
	// Topics to forward; each is published to the broker topic of the same
	// name. Defaults to the Outbox's Config.Topics.
	Topics []string
	// Name keys this forwarder's position in the offsets tables (the
	// consumer_group column watermill-sql's subscribers use for theirs; it
	// has nothing to do with Kafka consumer groups or the dedup key).
	// Instances with the same Name share the work (one at a time per topic,
	// by row lock); a forwarder of another Name forwards everything again.
	// [Outbox.Backlog] and [Outbox.DeleteForwarded] take it. At most 255
	// bytes. Defaults to [DefaultForwarderName].
	Name string
	// BatchSize is the most rows of one page: read with one query and sent
	// with one SendMessages (or Publish) call. Defaults to 1000.
	BatchSize int
	// BatchesPerTransaction is how many pages one transaction may send
	// before it commits the position; the next page is read while the
	// previous one is being sent. A crash resends at most
	// BatchSize*BatchesPerTransaction rows. Defaults to 4.
	BatchesPerTransaction int
	// PollInterval is the longest wait between two reads. After a read
	// that found rows the forwarder reads again after 1 ms (at once when a
	// wake-up came during it), and doubles the wait after each read that
	// found none, up to PollInterval; a read that finds nothing is one
	// query (index probes). A wake-up ends
	// a longer wait and starts the doubling again at 1 ms: a write to the
	// topic's table in this process (through this package, whichever
	// Outbox value it used), or a NOTIFY (see Listen). Defaults to 100 ms.
	PollInterval time.Duration
	// Listen turns on the wake-up on commit: the forwarder opens one
	// connection of its own (outside DB's pool, with its connection
	// settings) and LISTENs there on each topic's channel, which the
	// tables' idem_outbox_notify trigger notifies as a writing transaction
	// commits, so a committed row is read at once. The trigger is created
	// disabled: enable it (ALTER TABLE <table> ENABLE TRIGGER
	// idem_outbox_notify) on the topics that want it. NOTIFY takes a
	// server-wide lock at commit, which serialises the commits of the
	// notifying transactions (make bench measures the cost, in
	// docs/benchmarks.md#end-to-end-kafka--dedup--postgres--outbox--forwarder--kafka),
	// so it suits topics with few commits per second. LISTEN does not
	// work through a pooler in transaction mode. Defaults to false: the
	// forwarder polls (see PollInterval).
	Listen bool
	// RetryInterval is the wait after a failed transaction (it is rolled
	// back and the same rows are read again), the first wait between two
	// start-up attempts of Run (then doubled up to 30 s), and the wait
	// before the LISTEN connection is opened again. Defaults to 1 s.
	RetryInterval time.Duration
	// ShutdownTimeout is how long the in-flight batch may still take after
	// Close or cancellation before it is aborted (and later resent).
	// Defaults to 30 s.
	ShutdownTimeout time.Duration
	// SendTimeout is the longest one page's send to the broker may take
	// (the producer's own retries and timeouts decide; the forwarder does
	// not cut a send short). It sizes the server-side limits that free the
	// position's lock when a forwarder's host vanishes without a TCP
	// reset: each forwarder transaction sets, with SET LOCAL,
	// idle_in_transaction_session_timeout and tcp_user_timeout to
	// SendTimeout + 5 s (with a transactional producer, which the topics
	// share one Kafka transaction at a time, SendTimeout × the number of
	// Topics + 5 s), so the server ends a transaction whose client has
	// been silent that long and another instance takes the topic over.
	// A send slower than that ends its own transaction: it is rolled back
	// and its pages are sent again (copies, never a gap). Instances that
	// wait for the lock give up every 10 s (lock_timeout), log the holder
	// (its pid, address, state and age) and wait again. Negative: none of
	// these are set (the session's settings apply; with none, a vanished
	// holder keeps the lock until the kernel gives up on its connection,
	// about 2 h 11 min with Linux's default keepalives). Defaults to 30 s.
	SendTimeout time.Duration
	// StartupCheckTimeout bounds the check of the topics' tables that
	// [NewForwarder] runs (a few catalog queries), and each start-up
	// attempt of Run. Defaults to 10 s.
	StartupCheckTimeout time.Duration
	// TracerProvider makes one producer span per batch sent to the broker,
	// linked to the trace contexts stored with its rows (each record
	// carries its own as the traceparent header), with the topic, message
	// count, payload bytes and outbox lag. Defaults to nil: the global
	// provider (otel.GetTracerProvider), and no span while no SDK is
	// installed there.
	TracerProvider trace.TracerProvider
}

func (c *ForwarderConfig) setDefaults() {
	if c.Marshaler == nil {
		c.Marshaler = idemkafka.Marshaler{}
	}
	if len(c.Topics) == 0 && c.Outbox != nil {
		c.Topics = c.Outbox.cfg.Topics
	}
	if c.MaxMessageBytes == 0 && c.Outbox != nil {
		c.MaxMessageBytes = c.Outbox.cfg.MaxMessageBytes
	}
	if c.Name == "" {
		c.Name = DefaultForwarderName
	}
	if c.BatchSize == 0 {
		c.BatchSize = defaultBatchSize
	}
	if c.BatchesPerTransaction == 0 {
		c.BatchesPerTransaction = defaultBatchesPerTransaction
	}
	if c.PollInterval == 0 {
		c.PollInterval = defaultPollInterval
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = defaultRetryInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = defaultShutdownTimeout
	}
	if c.StartupCheckTimeout == 0 {
		c.StartupCheckTimeout = defaultStartupCheckTimeout
	}
	if c.SendTimeout == 0 {
		c.SendTimeout = defaultSendTimeout
	}
}

// limits are the server-side limits of the forwarder's transactions. With
// a transactional producer the topics' loops take turns on it (one Kafka
// transaction at a time), so a loop's database transaction may also sit
// idle while the other topics send: the idle limit covers one send per
// topic.
func (c ForwarderConfig) limits() outboxsql.Limits {
	if c.SendTimeout < 0 {
		return outboxsql.Limits{}
	}
	idle := c.SendTimeout
	if c.Producer != nil && c.Producer.IsTransactional() {
		idle *= time.Duration(max(len(c.Topics), 1))
	}
	return outboxsql.Limits{Idle: idle + idleMargin, Lock: lockWait}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy.
func (c ForwarderConfig) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c ForwarderConfig) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("DB: required")
	case c.Outbox == nil:
		return errors.New("Outbox: required")
	case c.Producer == nil && c.Publisher == nil:
		return errors.New("Producer or Publisher: one is required")
	case c.Producer != nil && c.Publisher != nil:
		return errors.New("Producer and Publisher: set only one")
	case len(c.Topics) == 0:
		return errors.New("Topics: required (here or in the Outbox's Config.Topics)")
	case c.BatchSize < 0:
		return errors.New("BatchSize: must not be negative")
	case c.BatchesPerTransaction < 0:
		return errors.New("BatchesPerTransaction: must not be negative")
	case c.PollInterval < 0 || c.RetryInterval < 0 || c.ShutdownTimeout < 0 || c.StartupCheckTimeout < 0:
		return errors.New("PollInterval, RetryInterval, ShutdownTimeout, StartupCheckTimeout: must not be negative")
	case len(c.Name) > maxNameLen:
		return fmt.Errorf("Name: longer than %d bytes", maxNameLen)
	}
	for _, t := range c.Topics {
		if err := c.Outbox.cfg.validateTopic(t); err != nil {
			return fmt.Errorf("Topics: %w", err)
		}
	}
	return nil
}

// ForwarderStats are counters since the forwarder was created.
type ForwarderStats struct {
	// Forwarded counts rows sent and acknowledged in the database.
	Forwarded uint64
	// Commits counts committed position updates; Polls counts every read.
	Commits, Polls uint64
	// Errors counts failed batches (rolled back, retried).
	Errors uint64
	// Quarantined counts rows moved to the dead tables: rows that cannot
	// be sent, and the later rows of their keys (see docs/outbox.md).
	Quarantined uint64
}
