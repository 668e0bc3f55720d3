package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// Forwarder defaults.
const (
	// DefaultForwarderGroup names the forwarder's position row in each
	// topic's offsets table.
	DefaultForwarderGroup = "outbox_forwarder"
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

// TxBeginner begins the forwarder's transactions (*pgxpool.Pool, *pgx.Conn).
type TxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// ForwarderConfig configures a [Forwarder]. Exactly one of Producer and
// Publisher is required.
type ForwarderConfig struct {
	// DB is the database holding the outbox tables. Required.
	DB TxBeginner
	// Outbox names the tables. Required.
	Outbox *Outbox
	// Producer is a Sarama SyncProducer built with
	// publisher.SaramaProducerConfig (idempotent, acks=all,
	// MaxOpenRequests=1): each batch goes out in one SendMessages call, in
	// order, keyed by partition_key. This is the fast path; see
	// [NewKafkaProducer]. The forwarder does not close it.
	Producer sarama.SyncProducer
	// Publisher is any Watermill publisher, e.g. a watermill-kafka publisher
	// built from publisher.NewKafkaPublisherConfig; each batch is one
	// Publish(topic, batch...) call. watermill-kafka sends the messages of
	// one call one at a time, so prefer Producer for Kafka. The forwarder
	// does not close it.
	Publisher message.Publisher
	// Marshaler turns rows into Kafka records when Producer is used.
	// Defaults to publisher.Marshaler (metadata as headers, key =
	// partition_key).
	Marshaler kafka.Marshaler
	// Topics to forward; each is published to the broker topic of the same
	// name. Defaults to the Outbox's Config.Topics.
	Topics []string
	// ConsumerGroup names this forwarder's position in the offsets tables.
	// Instances with the same group share the work (one at a time per
	// topic, by row lock); a different group forwards everything again.
	// Defaults to [DefaultForwarderGroup].
	ConsumerGroup string
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
}

func (c *ForwarderConfig) setDefaults() {
	if c.Marshaler == nil {
		c.Marshaler = publisher.Marshaler{}
	}
	if len(c.Topics) == 0 && c.Outbox != nil {
		c.Topics = c.Outbox.cfg.Topics
	}
	if c.ConsumerGroup == "" {
		c.ConsumerGroup = DefaultForwarderGroup
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
	case len(c.ConsumerGroup) > 255:
		return errors.New("ConsumerGroup: longer than 255 bytes")
	}
	for _, t := range c.Topics {
		if err := c.Outbox.cfg.validateTopic(t); err != nil {
			return fmt.Errorf("Topics: %w", err)
		}
	}
	return nil
}

// NewKafkaProducer returns a Sarama SyncProducer with the safe settings of
// publisher.SaramaProducerConfig, for [ForwarderConfig.Producer].
func NewKafkaProducer(cfg publisher.KafkaConfig) (sarama.SyncProducer, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("invalid config: Brokers: required")
	}
	return sarama.NewSyncProducer(cfg.Brokers, publisher.SaramaProducerConfig(cfg.Sarama))
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

	// beforeAck, when set (tests), runs after a batch was sent and before
	// its position is committed; an error aborts Run like a crash would.
	beforeAck func(topic string, n int) error
}

// NewForwarder validates cfg, verifies the tables of its topics as
// [Outbox.Check] does (within StartupCheckTimeout), and returns a Forwarder;
// [Forwarder.Run] starts it. A missing table is a [*TableError] wrapping
// [ErrTopicNotMigrated], a table of another shape one wrapping
// [ErrTableShape]: the service fails at start-up, not at its first batch.
// Create the tables (Outbox.Migrate) before the forwarder.
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
		cfg:     cfg,
		logger:  logger.With(watermill.LogFields{"forwarder_group": cfg.ConsumerGroup}),
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
	errs := make([]error, len(f.cfg.Topics))
	for i, topic := range f.cfg.Topics {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f.loop(stopCtx, topic); err != nil {
				errs[i] = err
				stop()
			}
		}()
	}
	wg.Wait()
	f.logger.Info("Outbox forwarder stopped", nil)
	return errors.Join(errs...)
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

// register inserts the forwarder's zero position row (watermill-sql's
// before-subscribing query), so that the row lock serialises instances.
func (f *Forwarder) register(ctx context.Context, topic string) error {
	queries, err := f.cfg.Outbox.offsets.BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams{Topic: topic, ConsumerGroup: f.cfg.ConsumerGroup})
	if err != nil {
		return fmt.Errorf("outbox forwarder: %w", err)
	}
	for _, q := range queries {
		if _, err := f.exec(ctx, q); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
				return fmt.Errorf("%w: topic %q: %w", ErrTopicNotMigrated, topic, err)
			}
			return fmt.Errorf("outbox forwarder: register topic %q: %w", topic, err)
		}
	}
	return nil
}

func (f *Forwarder) exec(ctx context.Context, q wsql.Query) (pgconn.CommandTag, error) {
	tx, err := f.cfg.DB.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer rollback(ctx, tx)
	tag, err := tx.Exec(ctx, q.Query, q.Args...)
	if err != nil {
		return tag, err
	}
	return tag, tx.Commit(ctx)
}

func (f *Forwarder) loop(stopCtx context.Context, topic string) error {
	logger := f.logger.With(watermill.LogFields{"topic": topic})
	for {
		if stopCtx.Err() != nil {
			return nil
		}
		_, full, err := f.forwardTx(stopCtx, topic, logger)
		var wait time.Duration
		switch {
		case errors.Is(err, errCrash):
			return err
		case err != nil:
			f.errs.Add(1)
			if isSerializationFailure(err) {
				// Another instance of the group moved the position under us.
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
				return nil
			case <-t.C:
			}
		}
	}
}

var errCrash = errors.New("outbox forwarder: stopped by test hook")

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.SerializationFailure || pgErr.Code == pgerrcode.DeadlockDetected)
}

// forwardTx forwards up to BatchesPerTransaction batches of topic in one
// transaction and reports how many rows it committed and whether the last
// read came back full (more rows are probably waiting).
//
// The transaction locks the group's position row, then (REPEATABLE READ:
// one snapshot, so one xmin) reads batch k+1 after batch k's last row while
// batch k is on its way to the broker, and moves the position row past
// batch k with watermill-sql's ack query. Batch k+1 is sent only
// once batch k was acknowledged, which keeps the order. The position
// commits when every batch of the transaction was sent; if any send fails,
// the transaction rolls back and all of them are sent again later.
func (f *Forwarder) forwardTx(stopCtx context.Context, topic string, logger watermill.LoggerAdapter) (n int, full bool, err error) {
	// The transaction itself is not cancelled by a stop: it gets
	// ShutdownTimeout to finish, so a graceful stop does not resend.
	ctx, cancel := context.WithCancel(context.WithoutCancel(stopCtx))
	defer cancel()
	stopWatch := context.AfterFunc(stopCtx, func() { time.AfterFunc(f.cfg.ShutdownTimeout, cancel) })
	defer stopWatch()

	tx, err := f.cfg.DB.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return 0, false, fmt.Errorf("begin: %w", err)
	}
	defer rollback(ctx, tx)
	// The position may commit asynchronously: if a server crash loses that
	// commit, the batches are sent again (at-least-once), never skipped.
	if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = off"); err != nil {
		return 0, false, fmt.Errorf("set synchronous_commit: %w", err)
	}

	pos, err := f.lock(ctx, tx, topic)
	if err != nil {
		return 0, false, err
	}
	batch, err := f.read(ctx, tx, topic, pos)
	if err != nil {
		return 0, false, err
	}
	var last wsql.Row
	for i := 0; len(batch) > 0; i++ {
		full = len(batch) == f.cfg.BatchSize
		sent := make(chan error, 1)
		go func(batch []wsql.Row) { sent <- f.send(topic, batch) }(batch)

		// While the broker works: advance the position past this batch and,
		// unless this is the transaction's last batch, read the next one.
		last = batch[len(batch)-1]
		pos = position{txID: strconv.FormatUint(uint64(last.ExtraData["transaction_id"].(wsql.XID8)), 10), offset: last.Offset}
		var next []wsql.Row
		err := f.ack(ctx, tx, topic, last)
		if err == nil && full && i+1 < f.cfg.BatchesPerTransaction && stopCtx.Err() == nil {
			next, err = f.read(ctx, tx, topic, pos)
		}
		if sendErr := <-sent; sendErr != nil {
			return 0, false, fmt.Errorf("send %d messages: %w", len(batch), sendErr)
		}
		if err != nil {
			return 0, false, err
		}
		if f.beforeAck != nil {
			if err := f.beforeAck(topic, len(batch)); err != nil {
				return 0, false, fmt.Errorf("%w: %w", errCrash, err)
			}
		}
		n += len(batch)
		batch = next
	}
	if n == 0 {
		return 0, false, nil
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("commit position: %w", err)
	}
	f.forwarded.Add(uint64(n))
	f.commits.Add(1)
	logger.Debug("Outbox messages forwarded", watermill.LogFields{"messages": n, "last_offset": last.Offset})
	return n, full, nil
}

// position is the last forwarded row: (transaction_id, offset).
type position struct {
	txID   string // xid8 as text
	offset int64
}

// lock reads the group's position in topic FOR UPDATE (watermill-sql's
// offsets row), so one forwarder of the group works on a topic at a time.
func (f *Forwarder) lock(ctx context.Context, tx pgx.Tx, topic string) (position, error) {
	var p position
	err := tx.QueryRow(ctx, `SELECT last_processed_transaction_id::text, offset_acked FROM `+f.cfg.Outbox.OffsetsTable(topic)+
		` WHERE consumer_group = $1 FOR UPDATE`, f.cfg.ConsumerGroup).Scan(&p.txID, &p.offset)
	if err != nil {
		return p, fmt.Errorf("lock position: %w", err)
	}
	return p, nil
}

// readSQL selects the rows after a position, only those written by
// transactions older than the snapshot's xmin, in (transaction_id, offset)
// order: watermill-sql's rule. Unlike watermill-sql's query, whose OR form
// is planned as a bitmap scan of every pending row plus a top-N sort (30 ms
// per batch with 100,000 rows pending, measured), the row comparison walks
// the primary key in order and stops after LIMIT rows, so a backlog does
// not slow every batch down. The text column is aliased: ORDER BY must see
// the xid8 column, not its text (where "10" sorts before "9").
func (f *Forwarder) readSQL(topic string) string {
	return `SELECT "offset", transaction_id::text AS xid, uuid, payload, metadata FROM ` + f.cfg.Outbox.MessagesTable(topic) + `
		WHERE (transaction_id, "offset") > ($1::xid8, $2)
		  AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY transaction_id, "offset"
		LIMIT $3`
}

// read returns the batch after pos.
func (f *Forwarder) read(ctx context.Context, tx pgx.Tx, topic string, pos position) ([]wsql.Row, error) {
	f.polls.Add(1)
	rows, err := tx.Query(ctx, f.readSQL(topic), pos.txID, pos.offset, f.cfg.BatchSize)
	if err != nil {
		return nil, fmt.Errorf("select: %w", err)
	}
	defer rows.Close()
	batch := make([]wsql.Row, 0, f.cfg.BatchSize)
	for rows.Next() {
		// What DefaultPostgreSQLSchema.UnmarshalMessage returns, scanned
		// directly: its generic Scan and encoding/json were most of the
		// read time.
		var (
			r    wsql.Row
			xid  string
			uuid string
		)
		if err := rows.Scan(&r.Offset, &xid, &uuid, &r.Payload, &r.Metadata); err != nil {
			return nil, fmt.Errorf("scan row: %w", err)
		}
		txID, err := strconv.ParseUint(xid, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("scan row: transaction_id %q: %w", xid, err)
		}
		r.UUID = []byte(uuid)
		r.Msg = message.NewMessage(uuid, r.Payload)
		if r.Metadata != nil {
			if r.Msg.Metadata, err = decodeMetadata(r.Metadata); err != nil {
				return nil, fmt.Errorf("row %d: metadata: %w", r.Offset, err)
			}
		}
		r.ExtraData = map[string]any{"transaction_id": wsql.XID8(txID)}
		batch = append(batch, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("select: %w", err)
	}
	return batch, nil
}

// ack moves the position (in tx) to last.
func (f *Forwarder) ack(ctx context.Context, tx pgx.Tx, topic string, last wsql.Row) error {
	q, err := f.cfg.Outbox.offsets.AckMessageQuery(wsql.AckMessageQueryParams{Topic: topic, LastRow: last, ConsumerGroup: f.cfg.ConsumerGroup})
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, q.Query, q.Args...); err != nil {
		return fmt.Errorf("advance position: %w", err)
	}
	return nil
}

func (f *Forwarder) send(topic string, batch []wsql.Row) error {
	if f.cfg.Publisher != nil {
		msgs := make([]*message.Message, len(batch))
		for i, r := range batch {
			msgs[i] = r.Msg
		}
		return f.cfg.Publisher.Publish(topic, msgs...)
	}
	pms := make([]*sarama.ProducerMessage, len(batch))
	for i, r := range batch {
		pm, err := f.cfg.Marshaler.Marshal(topic, r.Msg)
		if err != nil {
			return fmt.Errorf("marshal message %s: %w", r.Msg.UUID, err)
		}
		pms[i] = pm
	}
	return f.cfg.Producer.SendMessages(pms)
}
