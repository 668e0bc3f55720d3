package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/puddle/v2"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/internal/relaystep"
	"github.com/idemkit/watermill-idempotency/internal/wait"
	"github.com/idemkit/watermill-idempotency/migrate"
)

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
	// observe, when the context given to Run carries one (the bench's
	// step profile), gets each step of each loop with its time.
	observe relaystep.Observer
	// serial, when the context given to Run asks for it (the bench's
	// baseline), makes the loops work as before their reads were
	// pipelined (see relaystep.WithSerial).
	serial bool
}

func (f *Forwarder) step(name string) {
	if f.hook != nil {
		f.hook(name)
	}
}

// mark reports step of topic's loop to the observer, if any.
func (f *Forwarder) mark(topic string, step relaystep.Step) {
	if f.observe != nil {
		f.observe(topic, step, time.Now())
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
// forwards nothing until idemctl outbox reposition has reset the position.
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
	f.observe, f.serial = relaystep.From(ctx), relaystep.Serial(ctx)
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
		if isPositionError(err) {
			return err
		}
		f.logger.Error("Outbox forwarder cannot start, retrying", err, watermill.LogFields{"attempt": attempt, "retry_in": backoff.String()})
		if wait.Sleep(stopCtx, backoff) != nil {
			return fmt.Errorf("outbox forwarder: stopped before it could start: %w", err)
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
		if pgerr.Has(err, pgerrcode.UndefinedTable) {
			return fmt.Errorf("%w: topic %q: %w", ErrTopicNotMigrated, topic, err)
		}
		return fmt.Errorf("outbox forwarder: register topic %q: %w", topic, err)
	}
	return nil
}
