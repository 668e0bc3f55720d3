package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Forwarder defaults.
const (
	// DefaultForwarderName is the forwarder's name: the key of its position
	// row in each topic's offsets table.
	DefaultForwarderName = "outbox_forwarder"
	// DefaultBatchSize is how many rows one forwarder transaction reads and
	// sends.
	DefaultBatchSize = 1000
	// DefaultBatchesPerTransaction is how many batches one forwarder
	// transaction sends before it commits its position.
	DefaultBatchesPerTransaction = 4
	// DefaultPollInterval is the wait after an empty read.
	DefaultPollInterval = 100 * time.Millisecond
	// DefaultRetryInterval is the wait after a failed batch.
	DefaultRetryInterval = time.Second
	// DefaultShutdownTimeout bounds how long an in-flight batch may take to
	// finish after Close or context cancellation.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultStartupCheckTimeout bounds the table check of [NewForwarder].
	DefaultStartupCheckTimeout = 10 * time.Second
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
	// idemkafka.NewSyncProducer. The forwarder does not close it.
	Producer sarama.SyncProducer
	// Publisher is any Watermill publisher, e.g. a watermill-kafka publisher
	// built from idemkafka.WatermillPublisherConfig; each batch is one
	// Publish(topic, batch...) call. watermill-kafka sends the messages of
	// one call one at a time, so prefer Producer for Kafka. The forwarder
	// does not close it.
	Publisher message.Publisher
	// Marshaler turns rows into Kafka records when Producer is used.
	// Defaults to idemkafka.Marshaler (metadata as headers, key =
	// partition_key).
	Marshaler kafka.Marshaler
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
	// BatchSize is the most rows read and sent per transaction. Defaults to
	// [DefaultBatchSize].
	BatchSize int
	// BatchesPerTransaction is how many batches one transaction may send
	// before it commits the position; the next batch is read while the
	// previous one is being sent. A crash resends at most
	// BatchSize*BatchesPerTransaction rows. Defaults to
	// [DefaultBatchesPerTransaction].
	BatchesPerTransaction int
	// PollInterval is the wait after a read that was not full. Defaults to
	// [DefaultPollInterval].
	PollInterval time.Duration
	// RetryInterval is the wait after a failed batch (its transaction is
	// rolled back and the same rows are read again). Defaults to
	// [DefaultRetryInterval].
	RetryInterval time.Duration
	// ShutdownTimeout is how long the in-flight batch may still take after
	// Close or cancellation before it is aborted (and later resent).
	// Defaults to [DefaultShutdownTimeout].
	ShutdownTimeout time.Duration
	// StartupCheckTimeout bounds the check of the topics' tables that
	// [NewForwarder] runs (a few catalog queries). Defaults to
	// [DefaultStartupCheckTimeout] (10 s).
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
	if c.Name == "" {
		c.Name = DefaultForwarderName
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.BatchesPerTransaction == 0 {
		c.BatchesPerTransaction = DefaultBatchesPerTransaction
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = DefaultRetryInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.StartupCheckTimeout == 0 {
		c.StartupCheckTimeout = DefaultStartupCheckTimeout
	}
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
}

// Forwarder relays committed outbox rows to the broker: per topic, it reads
// a batch of rows in (transaction_id, offset) order, only below the
// snapshot's xmin, sends them in that order, then advances its position in
// the same transaction. A crash between send and commit resends the batch
// (at-least-once; the event ids make the copies harmless to a dedup
// consumer).
type Forwarder struct {
	cfg    ForwarderConfig
	logger watermill.LoggerAdapter

	closing   chan struct{}
	closeOnce sync.Once
	mu        sync.Mutex
	done      chan struct{} // closed when Run returns; nil before Run

	forwarded, commits, polls, errs atomic.Uint64
	tracing                         otelx.Tracers
}

// NewForwarder validates cfg, verifies the tables of its topics as
// [Outbox.Check] does (within StartupCheckTimeout), and returns a Forwarder;
// [Forwarder.Run] starts it. A missing table is a [*TableError] wrapping
// [ErrTopicNotMigrated], a table of another shape one wrapping
// [ErrTableShape]: the service fails at start-up, not at its first batch.
// Create the tables (outbox.MigrationLine) before the forwarder.
func NewForwarder(cfg ForwarderConfig, logger watermill.LoggerAdapter) (*Forwarder, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("forwarder: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cfg.Topics = append([]string(nil), cfg.Topics...)
	if err := checkForwarderTables(cfg); err != nil {
		return nil, err
	}
	return &Forwarder{
		tracing: otelx.Tracers{Configured: cfg.TracerProvider, Name: otelx.OutboxTracer},
		cfg:     cfg,
		logger:  logger.With(watermill.LogFields{"forwarder": cfg.Name}),
		closing: make(chan struct{}),
	}, nil
}

// checkForwarderTables verifies the topics' tables in a read-only
// transaction bounded by StartupCheckTimeout. Constructors here take no
// context, so the bound is the config's.
func checkForwarderTables(cfg ForwarderConfig) error {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartupCheckTimeout)
	defer cancel()
	tx, err := cfg.DB.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return fmt.Errorf("outbox forwarder: check tables: begin: %w", err)
	}
	defer rollback(ctx, tx)
	return cfg.Outbox.checkTopics(ctx, tx, cfg.Topics)
}

// Stats returns the counters.
func (f *Forwarder) Stats() ForwarderStats {
	return ForwarderStats{Forwarded: f.forwarded.Load(), Commits: f.commits.Load(), Polls: f.polls.Load(), Errors: f.errs.Load()}
}

// Run forwards until ctx is done or Close is called, then lets the in-flight
// batches finish (within ShutdownTimeout) and returns nil. It returns an
// error at once if a topic's tables are missing.
func (f *Forwarder) Run(ctx context.Context) error {
	f.mu.Lock()
	select {
	case <-f.closing:
		f.mu.Unlock()
		return nil
	default:
	}
	if f.done != nil {
		f.mu.Unlock()
		return errors.New("outbox forwarder: Run called twice")
	}
	done := make(chan struct{})
	f.done = done
	f.mu.Unlock()
	defer close(done)
	for _, topic := range f.cfg.Topics {
		if err := f.register(ctx, topic); err != nil {
			return err
		}
	}
	stopCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		select {
		case <-f.closing:
			stop()
		case <-stopCtx.Done():
		}
	}()
	f.logger.Info("Outbox forwarder started", watermill.LogFields{"topics": strings.Join(f.cfg.Topics, ",")})

	var wg sync.WaitGroup
	for _, topic := range f.cfg.Topics {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f.loop(stopCtx, topic)
		}()
	}
	wg.Wait()
	f.logger.Info("Outbox forwarder stopped", nil)
	return nil
}

// Close stops Run gracefully and waits for it to return.
func (f *Forwarder) Close() error {
	f.mu.Lock()
	f.closeOnce.Do(func() { close(f.closing) })
	done := f.done
	f.mu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}

// register gives the forwarder a position at the start of topic unless it
// has one, so that the row lock serialises instances.
func (f *Forwarder) register(ctx context.Context, topic string) error {
	if err := f.cfg.Outbox.tables(topic).Register(ctx, f.cfg.DB, f.cfg.Name); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
			return fmt.Errorf("%w: topic %q: %w", ErrTopicNotMigrated, topic, err)
		}
		return fmt.Errorf("outbox forwarder: register topic %q: %w", topic, err)
	}
	return nil
}

// loop forwards topic until stopCtx is done. A failed transaction is rolled
// back and retried: its batches are read and sent again.
func (f *Forwarder) loop(stopCtx context.Context, topic string) {
	logger := f.logger.With(watermill.LogFields{"topic": topic})
	tables := f.cfg.Outbox.tables(topic)
	for {
		if stopCtx.Err() != nil {
			return
		}
		full, err := f.forwardTx(stopCtx, tables, topic, logger)
		var wait time.Duration
		switch {
		case err != nil:
			f.errs.Add(1)
			if isSerializationFailure(err) {
				// Another instance of the same Name moved the position under us.
				logger.Debug("Outbox batch conflicted with another forwarder, retrying", watermill.LogFields{"err": err.Error()})
			} else {
				logger.Error("Outbox batch failed, retrying", err, watermill.LogFields{"retry_in": f.cfg.RetryInterval.String()})
				wait = f.cfg.RetryInterval
			}
		case !full:
			wait = f.cfg.PollInterval
		}
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-stopCtx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.SerializationFailure || pgErr.Code == pgerrcode.DeadlockDetected)
}

// batch is what one read returns: the messages, in order, and the position
// of the last one.
type batch struct {
	msgs []*message.Message
	last outboxsql.Position
}

// forwardTx forwards up to BatchesPerTransaction batches of topic in one
// transaction and reports whether the last read came back full (more rows
// are probably waiting).
//
// The transaction locks the forwarder's position row, then (REPEATABLE
// READ: one snapshot, so one xmin) reads batch k+1 after batch k's last row
// while batch k is on its way to the broker, and moves the position past
// batch k. Batch k+1 is sent only once batch k was acknowledged, which keeps
// the order. The position commits when every batch of the transaction was
// sent; if any send fails, the transaction rolls back and all of them are
// sent again later.
func (f *Forwarder) forwardTx(stopCtx context.Context, tables outboxsql.Tables, topic string, logger watermill.LoggerAdapter) (full bool, err error) {
	// The transaction itself is not cancelled by a stop: it gets
	// ShutdownTimeout to finish, so a graceful stop does not resend.
	ctx, cancel := context.WithCancel(context.WithoutCancel(stopCtx))
	defer cancel()
	stopWatch := context.AfterFunc(stopCtx, func() { time.AfterFunc(f.cfg.ShutdownTimeout, cancel) })
	defer stopWatch()

	tx, err := f.cfg.DB.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer rollback(ctx, tx)
	// The position may commit asynchronously: if a server crash loses that
	// commit, the batches are sent again (at-least-once), never skipped.
	if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = off"); err != nil {
		return false, fmt.Errorf("set synchronous_commit: %w", err)
	}

	pos, err := tables.Lock(ctx, tx, f.cfg.Name)
	if err != nil {
		return false, fmt.Errorf("lock position: %w", err)
	}
	b, err := f.read(ctx, tx, tables, pos)
	if err != nil {
		return false, err
	}
	n := 0
	for i := 0; len(b.msgs) > 0; i++ {
		full = len(b.msgs) == f.cfg.BatchSize
		sent := make(chan error, 1)
		go func(msgs []*message.Message) { sent <- f.send(topic, msgs) }(b.msgs)

		// While the broker works: advance the position past this batch and,
		// unless this is the transaction's last batch, read the next one.
		pos = b.last
		var next batch
		err := tables.Ack(ctx, tx, f.cfg.Name, pos)
		if err != nil {
			err = fmt.Errorf("advance position: %w", err)
		} else if full && i+1 < f.cfg.BatchesPerTransaction && stopCtx.Err() == nil {
			next, err = f.read(ctx, tx, tables, pos)
		}
		if sendErr := <-sent; sendErr != nil {
			return false, fmt.Errorf("send %d messages: %w", len(b.msgs), sendErr)
		}
		if err != nil {
			return false, err
		}
		n += len(b.msgs)
		b = next
	}
	if n == 0 {
		return false, nil
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit position: %w", err)
	}
	f.forwarded.Add(uint64(n))
	f.commits.Add(1)
	logger.Debug("Outbox messages forwarded", watermill.LogFields{"messages": n, "last_transaction_id": pos.TxID, "last_offset": pos.Offset})
	return full, nil
}

// read returns the batch after pos.
func (f *Forwarder) read(ctx context.Context, tx pgx.Tx, tables outboxsql.Tables, pos outboxsql.Position) (batch, error) {
	f.polls.Add(1)
	rows, err := tables.ReadBatch(ctx, tx, pos, f.cfg.BatchSize, make([]outboxsql.Row, 0, f.cfg.BatchSize))
	if err != nil {
		return batch{}, fmt.Errorf("read batch: %w", err)
	}
	b := batch{msgs: make([]*message.Message, len(rows))}
	for i, r := range rows {
		if b.msgs[i], err = r.Message(); err != nil {
			return batch{}, err
		}
	}
	if len(rows) > 0 {
		b.last = rows[len(rows)-1].Position
	}
	return b, nil
}

func (f *Forwarder) send(topic string, msgs []*message.Message) (err error) {
	if tr := f.tracing.Tracer(); tr != nil {
		span := startBatchSpan(tr, topic, msgs)
		defer func() {
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}()
	}
	if f.cfg.Publisher != nil {
		return f.cfg.Publisher.Publish(topic, msgs...)
	}
	pms := make([]*sarama.ProducerMessage, len(msgs))
	for i, msg := range msgs {
		pm, err := f.cfg.Marshaler.Marshal(topic, msg)
		if err != nil {
			return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
		}
		pms[i] = pm
	}
	return f.cfg.Producer.SendMessages(pms)
}

// startBatchSpan begins the span of one batch sent to the broker. A batch
// has many parents, so the messages' own trace contexts (stored with each
// row, sent on as their traceparent header) are links, not a parent.
func startBatchSpan(tr trace.Tracer, topic string, msgs []*message.Message) trace.Span {
	links := make([]trace.Link, 0, len(msgs))
	var bytes int
	var oldest time.Time
	for _, m := range msgs {
		bytes += len(m.Payload)
		if sc := otelx.Extract(m); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
		if t, err := time.Parse(time.RFC3339Nano, m.Metadata.Get(publisher.MetadataOccurredAt)); err == nil && (oldest.IsZero() || t.Before(oldest)) {
			oldest = t
		}
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingBatchMessageCount(len(msgs)),
		otelx.AttrBatchBytes.Int(bytes),
	}
	if !oldest.IsZero() {
		attrs = append(attrs, otelx.AttrOutboxLag.Float64(time.Since(oldest).Seconds()))
	}
	_, span := tr.Start(context.Background(), "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithLinks(links...), trace.WithAttributes(attrs...))
	return span
}
