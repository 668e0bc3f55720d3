package outbox

import (
	"bytes"
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
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
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
	// MaxMessageBytes is the largest record, as Sarama counts it against
	// Producer.MaxMessageBytes (ProducerMessage.ByteSize), that a row may
	// make; set it to the producer's. A larger row, and a row whose metadata
	// is unreadable or holds watermill-kafka's reserved UUID key, is never
	// sent: it moves to the topic's dead table with its cause, the later
	// rows of its partition key wait there behind it, and the topic goes on
	// (see [Outbox.DeadRows]). Negative: no size check. Defaults to the
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
	// with one SendMessages (or Publish) call. Defaults to
	// 1000.
	BatchSize int
	// BatchesPerTransaction is how many pages one transaction may send
	// before it commits the position; the next page is read while the
	// previous one is being sent. A crash resends at most
	// BatchSize*BatchesPerTransaction rows. Defaults to
	// 4.
	BatchesPerTransaction int
	// PollInterval is the longest wait between two reads. After a read
	// that found rows the forwarder reads again after 1 ms, and doubles
	// the wait after each read that found none, up to PollInterval; a
	// read that finds nothing is one query (index probes). A wake-up ends
	// a longer wait and starts the doubling again at 1 ms: a write to the
	// topic's table in this process (through this package, whichever
	// Outbox value it used), or a NOTIFY (see Listen). Defaults to
	// 100 ms.
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
	// before the LISTEN connection is opened again. Defaults to
	// 1 s.
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
	// SendTimeout + 5 s, so the server ends a transaction whose client has
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

// limits are the server-side limits of the forwarder's transactions.
func (c ForwarderConfig) limits() outboxsql.Limits {
	if c.SendTimeout < 0 {
		return outboxsql.Limits{}
	}
	return outboxsql.Limits{Idle: c.SendTimeout + idleMargin, Lock: lockWait}
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
	// be sent, and the later rows of their keys (see [Outbox.DeadRows]).
	Quarantined uint64
}

// Forwarder relays committed outbox rows to the broker. Per topic it
// forwards cut by cut: a cut is the rows whose writing transaction is
// visible in the current snapshot and not in the snapshot the previous cut
// ended at, sent in "offset" (insertion) order, in pages of BatchSize rows;
// the position (a snapshot, and the offset reached inside a cut) advances
// in the transaction that locked it, once the pages were acknowledged. A
// crash between send and commit resends those pages (at-least-once; the
// event ids make the copies harmless to a dedup consumer). It polls, faster
// while rows keep coming; writes in the same process wake it, and it can
// wake up on commit across processes (Listen).
type Forwarder struct {
	cfg    ForwarderConfig
	logger watermill.LoggerAdapter

	closing   chan struct{}
	closeOnce sync.Once
	mu        sync.Mutex
	done      chan struct{}   // closed when Run returns; nil before Run
	stopped   <-chan struct{} // closed when Run stops (ctx done or Close); nil before Run

	forwarded, commits, polls, errs, quarantined atomic.Uint64
	txnMu                                        sync.Mutex // one Kafka transaction at a time (sendTxn)
	tracing                                      otelx.Tracers

	// hook, when set (by tests, before Run), is called at each step of a
	// forwarder transaction: "begin", "locked", "cut", then for each page
	// "acked" (the position moved past it) and "sent", and "commit".
	hook func(step string)
	// stretch, when set (by tests, before Run), replaces the length of
	// every wait longer than minPollInterval.
	stretch func(time.Duration) time.Duration
}

func (f *Forwarder) step(name string) {
	if f.hook != nil {
		f.hook(name)
	}
}

// NewForwarder validates cfg, verifies the tables of its topics as
// [Outbox.Check] does (within StartupCheckTimeout), and returns a Forwarder;
// [Forwarder.Run] starts it. A missing table is a [*migrate.TableError] wrapping
// [ErrTopicNotMigrated], a table of another shape or with migrations
// pending one wrapping [ErrTableShape] or [migrate.ErrMigrationsPending]:
// the service fails at start-up, not at its first batch. Create the tables
// (outbox.MigrationLine) before the forwarder. Any other failure of the
// check (the database is unreachable, refuses the connection, ...) is logged
// and left to Run, which retries until the database answers.
func NewForwarder(cfg ForwarderConfig, logger watermill.LoggerAdapter) (*Forwarder, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("forwarder: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cfg.Topics = append([]string(nil), cfg.Topics...)
	f := &Forwarder{
		tracing: otelx.Tracers{Configured: cfg.TracerProvider, Name: otelx.OutboxTracer},
		cfg:     cfg,
		logger:  logger.With(watermill.LogFields{"forwarder": cfg.Name}),
		closing: make(chan struct{}),
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartupCheckTimeout)
	defer cancel()
	if err := f.checkTables(ctx); err != nil {
		var te *migrate.TableError
		if errors.As(err, &te) || errors.Is(err, puddle.ErrClosedPool) {
			return nil, err
		}
		f.logger.Error("Outbox forwarder cannot check its tables yet; Run will retry", err, nil)
	}
	return f, nil
}

// checkTables verifies the topics' tables in a read-only transaction.
func (f *Forwarder) checkTables(ctx context.Context) error {
	tx, err := f.cfg.DB.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return fmt.Errorf("outbox forwarder: check tables: begin: %w", err)
	}
	defer rollback(ctx, tx)
	return f.cfg.Outbox.checkTopics(ctx, tx, f.cfg.Topics)
}

// Stats returns the counters.
func (f *Forwarder) Stats() ForwarderStats {
	return ForwarderStats{Forwarded: f.forwarded.Load(), Commits: f.commits.Load(), Polls: f.polls.Load(), Errors: f.errs.Load(), Quarantined: f.quarantined.Load()}
}

// maxStartupBackoff caps the wait between two start-up attempts of Run.
const maxStartupBackoff = 30 * time.Second

// Run forwards until ctx is done or Close is called, then lets the in-flight
// batches finish (within ShutdownTimeout) and returns nil.
//
// A topic whose position was not written on the running cluster (restored
// from a dump, or moved to a logically replicated copy) stops every topic:
// Run returns its [*PositionError], at start-up or while it runs, and
// forwards nothing until [Outbox.Reposition] has reset the position.
//
// It starts by checking the topics' tables and registering the forwarder's
// position in each; while that fails (the database is down or refuses the
// connection, a table is missing, ...) it logs the failure and tries again,
// after RetryInterval and then twice as long each time, up to 30 s. If ctx
// ends (or Close is called) before it started, it returns the last failure.
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

	stopCtx, stop := context.WithCancel(ctx)
	defer stop()
	f.mu.Lock()
	f.stopped = stopCtx.Done()
	f.mu.Unlock()
	var (
		failOnce sync.Once
		failed   error
	)
	fail := func(err error) {
		failOnce.Do(func() { failed = err })
		stop()
	}
	go func() {
		select {
		case <-f.closing:
			stop()
		case <-stopCtx.Done():
		}
	}()
	if err := f.start(stopCtx); err != nil {
		return err
	}
	f.logger.Info("Outbox forwarder started", watermill.LogFields{"topics": strings.Join(f.cfg.Topics, ",")})

	wake := make(map[string]chan struct{}, len(f.cfg.Topics))
	for _, topic := range f.cfg.Topics {
		wake[topic] = make(chan struct{}, 1)
		defer wakers.add(f.cfg.Outbox.MessagesTable(topic), wake[topic])()
	}
	var wg sync.WaitGroup
	if f.cfg.Listen {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f.listen(stopCtx, wake)
		}()
	}
	for _, topic := range f.cfg.Topics {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f.loop(stopCtx, topic, wake[topic], fail)
		}()
	}
	wg.Wait()
	if failed != nil {
		f.logger.Error("Outbox forwarder stopped", failed, nil)
		return failed
	}
	f.logger.Info("Outbox forwarder stopped", nil)
	return nil
}

// start checks the tables and registers the forwarder in every topic,
// retrying with backoff until it succeeds or stopCtx ends.
func (f *Forwarder) start(stopCtx context.Context) error {
	backoff := max(f.cfg.RetryInterval, time.Millisecond)
	for attempt := 1; ; attempt++ {
		err := f.startOnce(stopCtx)
		if err == nil {
			return nil
		}
		if stopCtx.Err() != nil || errors.Is(err, puddle.ErrClosedPool) {
			return fmt.Errorf("outbox forwarder: stopped before it could start: %w", err)
		}
		if errors.Is(err, ErrPositionFromOtherCluster) {
			return err
		}
		f.logger.Error("Outbox forwarder cannot start, retrying", err, watermill.LogFields{"attempt": attempt, "retry_in": backoff.String()})
		t := time.NewTimer(backoff)
		select {
		case <-stopCtx.Done():
			t.Stop()
			return fmt.Errorf("outbox forwarder: stopped before it could start: %w", err)
		case <-t.C:
		}
		backoff = min(2*backoff, maxStartupBackoff)
	}
}

func (f *Forwarder) startOnce(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, f.cfg.StartupCheckTimeout)
	defer cancel()
	if err := f.checkTables(ctx); err != nil {
		return err
	}
	if err := f.checkServerTimeouts(ctx); err != nil {
		return err
	}
	for _, topic := range f.cfg.Topics {
		if err := f.register(ctx, topic); err != nil {
			return err
		}
		if err := f.checkPosition(ctx, topic); err != nil {
			return err
		}
	}
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

// listen wakes the topics' loops when a transaction that wrote to their
// tables commits: it LISTENs on each topic's channel (migration 2's trigger
// notifies it) on a connection of its own, opened with DB's connection
// settings. When the connection fails it reconnects after RetryInterval;
// meanwhile the loops poll.
func (f *Forwarder) listen(ctx context.Context, wake map[string]chan struct{}) {
	byChannel := make(map[string]chan struct{}, len(wake))
	for topic, ch := range wake {
		byChannel[f.cfg.Outbox.channel(topic)] = ch
	}
	signal := func(ch chan struct{}) {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	for ctx.Err() == nil {
		err := f.listenOnce(ctx, byChannel, signal)
		if ctx.Err() != nil {
			return
		}
		f.logger.Error("Outbox forwarder's LISTEN connection failed, polling until it is back", err, watermill.LogFields{"retry_in": f.cfg.RetryInterval.String()})
		t := time.NewTimer(f.cfg.RetryInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

func (f *Forwarder) listenOnce(ctx context.Context, byChannel map[string]chan struct{}, signal func(chan struct{})) error {
	conn, err := pgx.ConnectConfig(ctx, f.cfg.DB.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for ch := range byChannel {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			return fmt.Errorf("listen %s: %w", ch, err)
		}
	}
	// Commits before the LISTEN took effect sent nothing to this connection.
	for _, ch := range byChannel {
		signal(ch)
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if ch, ok := byChannel[n.Channel]; ok {
			signal(ch)
		}
	}
}

// minPollInterval is the first wait after a read that found rows; each
// read that finds none doubles it, up to PollInterval.
const minPollInterval = time.Millisecond

// known is the last position a loop saw: its own, or older than the
// truth when another instance moved it since (its cut then holds more
// rows, never fewer).
type known struct {
	pos outboxsql.Position
	ok  bool
}

// loop forwards topic until stopCtx is done. A failed transaction is rolled
// back and retried: its pages are read and sent again. Unless the last
// transaction forwarded rows, it first asks, in one query and without a
// lock, whether a new cut has any row; after a read that found rows it
// starts the next transaction after minPollInterval, and
// after each read that found none it waits twice as long, up to
// PollInterval. A wake-up (a write in this process, or a NOTIFY) ends a
// wait longer than minPollInterval and starts the doubling again.
//
// A position from another cluster is given to fail, and the loop returns.
func (f *Forwarder) loop(stopCtx context.Context, topic string, wake chan struct{}, fail func(error)) {
	logger := f.logger.With(watermill.LogFields{"topic": topic})
	tables := f.cfg.Outbox.tables(topic)
	var cache cutCache
	var last known
	idle := min(minPollInterval, f.cfg.PollInterval)
	// woken restarts the doubling: a wake-up says rows are on their way
	// (a NOTIFY: committed; a write in this process: committing), so the
	// reads after it start again at minPollInterval.
	woken := func() { idle = min(minPollInterval, f.cfg.PollInterval) / 2 }
	// busy is whether the last transaction forwarded rows: the next one
	// then starts without asking first (while rows keep coming, the
	// question costs a round trip and nearly always says yes).
	busy := false
	var holder int32 // the pid of the last holder of the position's lock logged
	for {
		if stopCtx.Err() != nil {
			return
		}
		// A wake-up that came before this read is answered by it.
		select {
		case <-wake:
			woken()
		default:
		}
		var (
			n    int
			more bool
			err  error
			wait time.Duration
		)
		if last.ok && last.pos.Cut == nil && !busy {
			f.polls.Add(1)
			var has bool
			has, err = tables.HasRows(stopCtx, f.cfg.DB, last.pos, f.cfg.Name)
			if stopCtx.Err() != nil {
				return
			}
			if err == nil && !has {
				idle = max(min(2*idle, f.cfg.PollInterval), time.Microsecond)
				if f.sleep(stopCtx, wake, idle) {
					woken()
				}
				continue
			}
			if err != nil {
				err = fmt.Errorf("look for a cut: %w", err)
			}
		}
		if err == nil {
			n, more, err = f.forwardTx(stopCtx, tables, topic, logger, &cache, &last)
		}
		if errors.Is(err, ErrPositionFromOtherCluster) {
			f.errs.Add(1)
			fail(err)
			return
		}
		if errors.Is(err, errLockBusy) {
			cache, last = cutCache{}, known{}
			f.logHolder(stopCtx, tables, logger, &holder)
			continue
		}
		if errors.Is(err, outboxsql.ErrNoPosition) {
			cache, last = cutCache{}, known{}
			if err = f.recreatePosition(stopCtx, topic, logger); err == nil {
				continue
			}
		}
		retry := false
		busy = err == nil && n > 0
		switch {
		case err != nil:
			f.errs.Add(1)
			retry = true
			cache, last = cutCache{}, known{}
			if isSerializationFailure(err) {
				logger.Debug("Outbox batch conflicted with another forwarder, retrying", watermill.LogFields{"err": err.Error()})
			} else {
				logger.Error("Outbox batch failed, retrying", err, watermill.LogFields{"retry_in": f.cfg.RetryInterval.String()})
				wait = f.cfg.RetryInterval
			}
		case more:
		case n > 0:
			idle = min(minPollInterval, f.cfg.PollInterval)
			wait = idle
		default:
			idle = max(min(2*idle, f.cfg.PollInterval), time.Microsecond)
			wait = idle
		}
		if retry {
			// A failed transaction waits its RetryInterval whatever
			// writers do.
			f.sleep(stopCtx, nil, wait)
		} else if f.sleep(stopCtx, wake, wait) {
			woken()
		}
		if stopCtx.Err() != nil {
			return
		}
	}
}

// sleep waits d, or until a wake-up on wake (nil: none), and reports
// whether a wake-up ended it. A wait of minPollInterval or less (the pause
// after a read that found rows) is not cut short: while rows keep coming,
// each read takes what arrived during that pause, rather than one read per
// write.
func (f *Forwarder) sleep(stopCtx context.Context, wake chan struct{}, d time.Duration) (woke bool) {
	if d <= 0 {
		return false
	}
	if d <= minPollInterval {
		wake = nil
	} else if f.stretch != nil {
		d = f.stretch(d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stopCtx.Done():
	case <-wake:
		return true
	case <-t.C:
	}
	return false
}

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.SerializationFailure || pgErr.Code == pgerrcode.DeadlockDetected)
}

// cutCache keeps the pages of a cut that did not fit in one transaction, so
// that the next transaction continues it without reading its keys again,
// and the first of those pages already read (ahead), so that the next
// transaction starts sending at once.
type cutCache struct {
	cut   outboxsql.Cut
	next  int    // index of the first page not yet forwarded
	ahead *batch // cut.Pages[next], read by the previous transaction, or nil
}

// pagesAfter returns the cached pages that continue p, and the first one
// already read if it was, or false when the cache does not fit p (another
// instance moved the position, or none).
func (c *cutCache) pagesAfter(p outboxsql.Position) ([]outboxsql.Page, *batch, bool) {
	if p.Cut == nil || c.next == 0 || c.next >= len(c.cut.Pages) ||
		c.cut.From.String() != p.Snapshot.String() || c.cut.To.String() != p.Cut.String() ||
		c.cut.Pages[c.next-1].Last != p.CutOffset {
		return nil, nil, false
	}
	return c.cut.Pages[c.next:], c.ahead, true
}

// forwardTx forwards up to BatchesPerTransaction pages of topic in one
// transaction and reports whether the cut it worked on has pages left.
//
// The transaction locks the forwarder's position row (READ COMMITTED: every
// statement after the lock sees at least what the previous holder
// committed), reads the pages of the cut that continues the position, or of
// a new cut ending at the read's own snapshot, then sends page k while it
// moves the position past it and reads page k+1. Page k+1 is sent only once
// page k was acknowledged, which keeps the order. The position commits when
// every page of the transaction was sent; if any send fails, the
// transaction rolls back and all of them are sent again later.
func (f *Forwarder) forwardTx(stopCtx context.Context, tables outboxsql.Tables, topic string, logger watermill.LoggerAdapter, cache *cutCache, last *known) (n int, more bool, err error) {
	// The transaction itself is not cancelled by a stop: it gets
	// ShutdownTimeout to finish, so a graceful stop does not resend.
	ctx, cancel := context.WithCancel(context.WithoutCancel(stopCtx))
	defer cancel()
	stopWatch := context.AfterFunc(stopCtx, func() { time.AfterFunc(f.cfg.ShutdownTimeout, cancel) })
	defer stopWatch()
	f.step("begin")

	conn, err := f.cfg.DB.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("acquire a connection: %w", err)
	}
	defer conn.Release()
	// The wait for the lock ends at once on a stop: nothing was sent yet.
	lockCtx, stopLock := context.WithCancel(ctx)
	defer stopLock()
	unwatch := context.AfterFunc(stopCtx, stopLock)
	tx, pos, err := tables.BeginLock(lockCtx, conn.Conn(), f.cfg.Name, f.cfg.limits())
	unwatch()
	if err != nil {
		if stopCtx.Err() != nil && lockCtx.Err() != nil {
			return 0, false, nil
		}
		if outboxsql.IsLockTimeout(err) {
			return 0, false, errLockBusy
		}
		if pe := positionError(err, topic); pe != err {
			return 0, false, pe
		}
		return 0, false, fmt.Errorf("begin and lock position: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))

	*last = known{pos: pos, ok: true}
	f.polls.Add(1)
	f.step("locked")
	pages, ahead, ok := cache.pagesAfter(pos)
	if !ok {
		cut, err := tables.ReadCut(ctx, tx, pos, f.cfg.BatchSize)
		if err != nil {
			return 0, false, fmt.Errorf("read cut: %w", err)
		}
		*cache = cutCache{cut: cut}
		pages, ahead = cut.Pages, nil
	}
	cache.ahead = nil
	cut := cache.cut
	f.step("cut")
	if len(pages) == 0 {
		if pos.Cut == nil {
			return 0, false, nil
		}
		// A cut with nothing left to send (a position of watermill-sql's
		// kind that had passed its transaction's last row): close it.
		closed := outboxsql.Position{Snapshot: *pos.Cut}
		if err := tables.Ack(ctx, tx, f.cfg.Name, closed); err != nil {
			return 0, false, fmt.Errorf("advance position: %w", err)
		}
		if err := f.commit(ctx, tx, 0); err != nil {
			return 0, false, err
		}
		*last = known{pos: closed, ok: true}
		return 0, false, nil
	}

	// The keys with dead rows, read after the cut: a key an operator
	// retried (its rows moved back in one commit) is no longer among them
	// whenever its moved rows are in the cut.
	dead, err := tables.DeadKeys(ctx, tx)
	if err != nil {
		return 0, false, fmt.Errorf("read dead keys: %w", err)
	}
	b := ahead
	if b == nil {
		if b, err = f.readPage(ctx, tx, tables, topic, pages[0], dead, logger); err != nil {
			return 0, false, err
		}
	}
	for i := 0; ; i++ {
		// Stop is read once per page: whether this page ends the
		// transaction and whether the next one is read ahead must agree,
		// or a stop between the two would leave no page to send next.
		stopping := stopCtx.Err() != nil
		sent := make(chan error, 1)
		if b.size() == 0 { // the page's rows were deleted meanwhile
			sent <- nil
		} else {
			go func(b *batch) { sent <- f.send(topic, b) }(b)
		}

		// While the broker works: move the position past this page and
		// read the next one, even when this transaction ends with this
		// page (the next transaction then starts by sending it).
		if i == len(pages)-1 {
			pos = outboxsql.Position{Snapshot: cut.To}
		} else {
			pos = outboxsql.Position{Snapshot: cut.From, Cut: &cut.To, CutOffset: pages[i].Last}
		}
		var next *batch
		last := i == len(pages)-1 || i+1 == f.cfg.BatchesPerTransaction || stopping
		err := tables.Ack(ctx, tx, f.cfg.Name, pos)
		f.step("acked")
		if err != nil {
			err = fmt.Errorf("advance position: %w", err)
		} else if i < len(pages)-1 && !stopping {
			next, err = f.readPage(ctx, tx, tables, topic, pages[i+1], dead, logger)
		}
		if sendErr := <-sent; sendErr != nil {
			return 0, false, fmt.Errorf("send %d messages: %w", b.size(), sendErr)
		}
		f.step("sent")
		if err != nil {
			return 0, false, err
		}
		n += b.size()
		if last {
			cache.next = len(cut.Pages) - len(pages) + i + 1
			cache.ahead = next
			break
		}
		b = next
	}
	if err := f.commit(ctx, tx, n); err != nil {
		cache.ahead = nil
		return 0, false, err
	}
	*last = known{pos: pos, ok: true}
	logger.Debug("Outbox messages forwarded", watermill.LogFields{"messages": n, "position": pos.Snapshot.String(), "cut_offset": pos.CutOffset})
	return n, pos.Cut != nil, nil
}

func (f *Forwarder) commit(ctx context.Context, tx *outboxsql.Tx, n int) error {
	f.step("commit")
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit position: %w", err)
	}
	f.forwarded.Add(uint64(n))
	f.commits.Add(1)
	return nil
}

// batch is one page ready to send: its messages in order, and with a
// Producer their Kafka records (then msgs may be nil: see readPage).
type batch struct {
	msgs    []*message.Message
	records []*sarama.ProducerMessage
}

// size is the number of messages of b.
func (b *batch) size() int { return max(len(b.msgs), len(b.records)) }

// readPage reads the rows of page, in order, and with a Producer marshals
// them: this runs while the previous page is being sent. With the default
// Marshaler and no tracing, a row whose metadata is the compact JSON
// watermill-sql writes becomes its record directly (fastRecord), without a
// Watermill message in between.
//
// A row that cannot be sent (its record is over MaxMessageBytes, its
// metadata is unreadable or holds a reserved key) is quarantined: moved, on
// tx, to the topic's dead table with its cause, and its key joins dead. A
// row whose key is in dead (a poison row of the key came before it) is
// moved there too, held behind it, so that the key's order is kept when an
// operator retries the key. Neither is sent.
func (f *Forwarder) readPage(ctx context.Context, tx outboxsql.DB, tables outboxsql.Tables, topic string, page outboxsql.Page, dead map[string]int64, logger watermill.LoggerAdapter) (*batch, error) {
	rows, err := tables.ReadPage(ctx, tx, page, make([]outboxsql.Row, 0, page.Rows))
	if err != nil {
		return nil, fmt.Errorf("read page: %w", err)
	}
	b := &batch{}
	_, defaultMarshaler := f.cfg.Marshaler.(idemkafka.Marshaler)
	fast := f.cfg.Producer != nil && defaultMarshaler && f.tracing.Tracer() == nil
	if fast {
		b.records = make([]*sarama.ProducerMessage, 0, len(rows))
	} else {
		b.msgs = make([]*message.Message, 0, len(rows))
		if f.cfg.Producer != nil {
			b.records = make([]*sarama.ProducerMessage, 0, len(rows))
		}
	}
	for _, r := range rows {
		var (
			pm    *sarama.ProducerMessage
			msg   *message.Message
			key   string
			size  int
			cause error
		)
		if fast {
			if rec, ok := fastRecord(topic, r); ok {
				pm = rec
				if rec.Key != nil {
					key = string(rec.Key.(sarama.StringEncoder))
				}
			}
		}
		if pm == nil {
			if msg, cause = r.Message(); cause == nil {
				key = msg.Metadata.Get(publisher.MetadataPartitionKey)
				if cause = idemkafka.CheckRecord(msg, 0); cause == nil && f.cfg.Producer != nil {
					if pm, cause = f.cfg.Marshaler.Marshal(topic, msg); cause != nil {
						cause = fmt.Errorf("marshal: %w", cause)
					}
				}
				if pm == nil && cause == nil {
					size = idemkafka.RecordBytes(msg)
				}
			}
		}
		if pm != nil {
			size = pm.ByteSize(2)
		}
		if cause == nil && f.cfg.MaxMessageBytes > 0 && size > f.cfg.MaxMessageBytes {
			cause = fmt.Errorf("%w: %d bytes > MaxMessageBytes %d", publisher.ErrMessageTooLarge, size, f.cfg.MaxMessageBytes)
		}
		held, isHeld := dead[key]
		isHeld = isHeld && key != ""
		if cause == nil && !isHeld {
			if fast {
				b.records = append(b.records, pm)
			} else {
				b.msgs = append(b.msgs, msg)
				if f.cfg.Producer != nil {
					b.records = append(b.records, pm)
				}
			}
			continue
		}
		if err := f.quarantine(ctx, tx, tables, topic, r, key, size, cause, held, dead, logger); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// quarantine moves row r to the dead table: as a poison row (cause) whose
// key then holds its later rows, or as a row held behind the dead row held.
func (f *Forwarder) quarantine(ctx context.Context, tx outboxsql.DB, tables outboxsql.Tables, topic string, r outboxsql.Row,
	key string, size int, cause error, held int64, dead map[string]int64, logger watermill.LoggerAdapter) error {
	text := ""
	if cause != nil {
		text, held = cause.Error(), 0
	} else {
		text = "held behind dead row " + strconv.FormatInt(held, 10) + " of its partition key"
	}
	id, err := tables.Quarantine(ctx, tx, r, key, text, held, size)
	if err != nil {
		return fmt.Errorf("quarantine row %d: %w", r.Offset, err)
	}
	if id == 0 {
		return nil // deleted meanwhile
	}
	f.quarantined.Add(1)
	fields := watermill.LogFields{"topic": topic, "offset": r.Offset, "message_uuid": r.UUID, "partition_key": key, "size": size, "dead_id": id}
	if cause != nil {
		if key != "" {
			dead[key] = id
		}
		fields["max_message_bytes"] = f.cfg.MaxMessageBytes
		logger.Error("Outbox row cannot be sent: moved to the dead table, its key's later rows wait behind it (idemctl outbox dead)", &RowError{Topic: topic, Offset: r.Offset, UUID: r.UUID, Key: key, Size: size, Err: cause}, fields)
	} else {
		fields["held_behind"] = held
		logger.Info("Outbox row held behind a dead row of its key: moved to the dead table", fields)
	}
	return nil
}

// uuidHeaderKey is watermill-kafka's header of the message UUID.
var uuidHeaderKey = []byte(kafka.UUIDHeaderKey)

// fastRecord returns the record idemkafka.Marshaler makes of row's message
// (the UUID header, one header per metadata entry, key = partition_key),
// built from the row's bytes, or false when row's metadata is not the
// compact, escape-free JSON object of distinct keys FlatPairs reads, or
// holds watermill-kafka's reserved UUID key: the caller then goes the
// long way, which decodes anything and reports the reserved key.
func fastRecord(topic string, row outboxsql.Row) (*sarama.ProducerMessage, bool) {
	headers := make([]sarama.RecordHeader, 1, 10)
	headers[0] = sarama.RecordHeader{Key: uuidHeaderKey, Value: []byte(row.UUID)}
	var key []byte
	if row.Metadata != nil {
		ok := outboxsql.FlatPairs(row.Metadata, func(k, v []byte) {
			headers = append(headers, sarama.RecordHeader{Key: k, Value: v})
			if string(k) == publisher.MetadataPartitionKey {
				key = v
			}
		})
		if !ok {
			return nil, false
		}
		for i := 1; i < len(headers); i++ {
			if bytes.Equal(headers[i].Key, uuidHeaderKey) {
				return nil, false
			}
			for j := 1; j < i; j++ {
				if bytes.Equal(headers[i].Key, headers[j].Key) {
					return nil, false
				}
			}
		}
	}
	pm := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(row.Payload), Headers: headers}
	if len(key) > 0 {
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, true
}

func (f *Forwarder) send(topic string, b *batch) (err error) {
	if tr := f.tracing.Tracer(); tr != nil {
		span := startBatchSpan(tr, topic, b.msgs)
		defer func() {
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}()
	}
	if f.cfg.Publisher != nil {
		return f.cfg.Publisher.Publish(topic, b.msgs...)
	}
	if f.cfg.Producer.IsTransactional() {
		return f.sendTxn(b.records)
	}
	return f.cfg.Producer.SendMessages(b.records)
}

// sendTxn sends records as one Kafka transaction: all of them become
// visible to read_committed consumers, or none (the transaction is aborted
// when any record fails, and the caller sends the page again). The topics'
// loops share the producer, and a producer runs one transaction at a time.
func (f *Forwarder) sendTxn(records []*sarama.ProducerMessage) error {
	f.txnMu.Lock()
	defer f.txnMu.Unlock()
	p := f.cfg.Producer
	if err := p.BeginTxn(); err != nil {
		return fmt.Errorf("begin Kafka transaction: %w", err)
	}
	err := p.SendMessages(records)
	if err == nil {
		if err = p.CommitTxn(); err == nil {
			return nil
		}
		err = fmt.Errorf("commit Kafka transaction: %w", err)
	}
	// A fatal error (fenced by another producer of the same id, say) leaves
	// nothing to abort: every later send fails until the producer is
	// replaced, and the error says why.
	if st := p.TxnStatus(); st&(sarama.ProducerTxnFlagInTransaction|sarama.ProducerTxnFlagAbortableError) != 0 && st&sarama.ProducerTxnFlagFatalError == 0 {
		if abortErr := p.AbortTxn(); abortErr != nil {
			return errors.Join(err, fmt.Errorf("abort Kafka transaction: %w", abortErr))
		}
	}
	return err
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
