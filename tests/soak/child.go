package soak

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptrace"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/handlertracer"
	"github.com/idemkit/watermill-idempotency/internal/retryheaders"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// ConsumerEnv names the environment variable that makes [RunConsumerIfChild]
// run the process as one soak consumer. The soak starts each consumer
// instance by re-executing its own binary ([Config.Executable]) with this
// variable set to the instance's settings, so that it can kill instances
// with SIGKILL: a real process death, where the member never leaves its
// consumer group, its TCP connections drop and its open transaction is
// rolled back by PostgreSQL.
const ConsumerEnv = "IDEM_SOAK_CONSUMER"

// RunConsumerIfChild returns at once unless [ConsumerEnv] is set; then it
// runs a soak consumer until SIGTERM (or its standard input closes: the soak
// is gone) and exits the process. Call it first in main, or in TestMain of a
// test binary that runs the soak.
func RunConsumerIfChild() {
	v, ok := os.LookupEnv(ConsumerEnv)
	if !ok {
		return
	}
	var cfg childConfig
	if err := json.Unmarshal([]byte(v), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "soak consumer: %s: %v\n", ConsumerEnv, err)
		os.Exit(2)
	}
	if err := runConsumer(cfg); err != nil {
		fmt.Fprintf(os.Stderr, "soak consumer %s: %v\n", cfg.Instance, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// childConfig is what a consumer process gets from the soak, as JSON in
// [ConsumerEnv].
type childConfig struct {
	DatabaseURL string   `json:"database_url"`
	Database    string   `json:"database"`
	Schema      string   `json:"schema"`
	AppName     string   `json:"app_name"` // application_name, which the pg-terminate fault targets
	Brokers     []string `json:"brokers"`
	Topic       string   `json:"topic"`
	DLQ         string   `json:"dlq"`
	RetryTopics []string `json:"retry_topics"`
	PoisonTopic string   `json:"poison_topic"`
	Retries     int      `json:"in_process_retries"` // MaxRetries of watermill's Retry
	Group       string   `json:"group"`
	Instance    string   `json:"instance"`
	CopyToDLQ   bool     `json:"copy_to_dlq"`
	Unsafe      bool     `json:"unsafe_ledger_outside_tx"`
	MaxConns    int32    `json:"max_conns"`
	Verbose     bool     `json:"verbose"`
	GroupCommit bool     `json:"group_commit"`
	Parallel    bool     `json:"parallel"` // idemkafka's parallel subscriber on every topic
	// Lease mode (idem.Config.Lease): the lease's duration, and the fake
	// provider the handler calls (docs/soak.md, "The lease-mode leg").
	Lease         bool          `json:"lease"`
	LeaseDuration time.Duration `json:"lease_duration"`
	ProviderURL   string        `json:"provider_url"`
	UnstableKey   bool          `json:"unstable_key"` // a new Idempotency-Key per call: the checker's own test
}

// The consumer-to-soak protocol: one line on standard output per event.
const (
	lineReady         = "ready"
	lineDelivery      = "d"   // a message of the main topic reached the outer middleware
	lineDeliveryRetry = "dr"  // a message of a retry topic did
	lineApplied       = "a"   // the handler ran and its transaction committed
	lineAppliedRetry  = "ar"  // the same, for a message of a retry topic
	lineDuplicate     = "u"   // acked without running the handler
	lineFailed        = "f"   // error returned: nacked, redelivered
	lineTransient     = "t"   // the handler returned a planned transient failure
	lineEscalated     = "r "  // + attempt + " " + event id + " " + cause: moved to a retry topic after a failure
	lineDeferred      = "s"   // acked to the retry path without running: follows its key's parked event, or is already there
	linePoisoned      = "p "  // + event id + reason: published to the poison topic
	lineDLQ           = "q "  // + event id: a copy was published to the dead-letter topic
	lineKill          = "k "  // + fault kind: about to SIGKILL itself
	lineJoined        = "j"   // every consumer group of the process has had its first session
	lineViolation     = "v "  // + description
	lineHandlers      = "h "  // + n: a new high of main-topic messages in the handler chain at once
	cmdKillMid        = "mid" // soak-to-consumer commands, on standard input
	cmdKillCommit     = "commit"
	cmdKillCall       = "call" // lease mode: die while a call to the provider is in flight
)

// The retry-topic settings of the consumers: short delays, so that a soak
// does not wait for its copies, and enough attempts to outlast a database
// disruption (the delays add up to 11 s, ±20 %) so that no event is
// poisoned.
const (
	retryMaxAttempts  = 8
	retryInitialDelay = 200 * time.Millisecond
	retryMaxDelay     = 2 * time.Second
)

// tableConfig is the processed_event table of a run, for the soak and its
// consumer processes alike.
func tableConfig(schema string) deduplicator.TableConfig {
	return deduplicator.TableConfig{Schema: schema}
}

// parkedTable is the parked-keys table of a run (retrytopic.KeyOrder).
func parkedTable(schema string) retrytopic.ParkedKeysTable {
	return retrytopic.ParkedKeysTable{Schema: schema}
}

// pgPool opens a pool on the run's database and schema, its connections
// named application_name.
func pgPool(ctx context.Context, url, database, schema, applicationName string, maxConns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pc.ConnConfig.Database = database
	pc.ConnConfig.RuntimeParams["search_path"] = schema
	pc.ConnConfig.RuntimeParams["application_name"] = applicationName
	pc.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, pc)
}

type child struct {
	cfg  childConfig
	pool *pgxpool.Pool
	// downPool is the planned failures' "downstream": the handler counts
	// an event's failures through it while it holds the transaction's
	// connection of pool.
	downPool *pgxpool.Pool
	dlqPub   *kafka.Publisher
	rt       *retrytopic.RetryTopic
	// client calls the fake provider (lease mode), with the event's
	// Idempotency-Key.
	client   *http.Client
	poisoned sync.Map     // message UUID → true: published to the poison topic
	armed    atomic.Int32 // pendingKillMid / pendingKillCommit / pendingKillMidCall

	sessMu    sync.Mutex
	joined    []bool      // per subscriber: its consumer group has had a session
	allJoined atomic.Bool // every one has: the armed kills may run
	outMu     sync.Mutex

	handlers, maxHandlers atomic.Int64 // main-topic messages in the chain now, and the most so far
}

// emit writes one protocol line, unbuffered: a line written before a
// SIGKILL reaches the soak.
func (c *child) emit(line string) {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	_, _ = os.Stdout.WriteString(line + "\n")
}

// die kills the process with SIGKILL, at the exact point of the fault.
func (c *child) die(kind string) {
	c.emit(lineKill + kind)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

func runConsumer(cfg childConfig) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	dumpGoroutinesOnSIGUSR1(cfg.Instance)
	c := &child{cfg: cfg}
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			switch in.Text() {
			case cmdKillMid:
				c.armed.Store(pendingKillMid)
			case cmdKillCommit:
				c.armed.Store(pendingKillCommit)
			case cmdKillCall:
				c.armed.Store(pendingKillMidCall)
			}
		}
		stop() // the soak closed our input, or is gone
	}()

	var logger watermill.LoggerAdapter = errorLogger{watermill.NewStdLoggerWithOut(os.Stderr, false, false)}
	if cfg.Verbose {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, false, false)
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.LstdFlags|log.Lmicroseconds)
	}
	logger = logger.With(watermill.LogFields{"instance": cfg.Instance})

	var err error
	if c.pool, err = pgPool(ctx, cfg.DatabaseURL, cfg.Database, cfg.Schema, cfg.AppName, cfg.MaxConns); err != nil {
		return err
	}
	defer c.pool.Close()
	if c.downPool, err = pgPool(ctx, cfg.DatabaseURL, cfg.Database, cfg.Schema, cfg.AppName, 2); err != nil {
		return err
	}
	defer c.downPool.Close()
	// The database may be refusing connections (a disruption): retry.
	var dedup *idem.Dedup
	if err := retry(ctx, "dedup middleware", func() error {
		dcfg := idem.Config{DB: c.pool, ConsumerGroup: cfg.Group, Table: tableConfig(cfg.Schema)}
		if cfg.Parallel {
			// Every topic's subscriber hands out up to its MaxInFlight
			// messages at once.
			dcfg.Concurrency = ParallelMaxInFlight + len(cfg.RetryTopics)*ParallelRetryMaxInFlight
		}
		if cfg.GroupCommit {
			dcfg.GroupCommit = &idem.GroupCommitConfig{}
		}
		if cfg.Lease {
			// One transaction at a time per phase (batched): the pool's
			// 2 x 1 + 1 connections, and the process's soak pools, stay
			// within the suite's connection budget. Owner: the lease table
			// tells which process held a lease that was taken over.
			// FastPath off: the run's kills between the phases are to leave
			// lease rows for the next owner to take over (a kill inside
			// the fast path leaves an aborted transaction instead; the
			// middleware's TestFastPath_* tests show that case).
			dcfg.Lease = &idem.LeaseConfig{Duration: cfg.LeaseDuration, Concurrency: 1, Owner: cfg.Instance, FastPath: -1}
		}
		dedup, err = idem.NewDedup(dcfg, logger)
		return err
	}); err != nil {
		return err
	}
	if cfg.Lease {
		c.client = &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "charge"), Timeout: 30 * time.Second}
	}
	kc := idemkafka.ClientConfig{Brokers: cfg.Brokers}
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	if err != nil {
		return err
	}
	pub, err := kafka.NewPublisher(pc, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	if cfg.CopyToDLQ {
		c.dlqPub = pub
	}
	// KeyOrder hands a key on to its next parked event through the outbox,
	// to the first retry topic: every consumer process forwards it (the
	// forwarders of one name share the work).
	ob, err := handoffOutbox(cfg.Schema, cfg.RetryTopics, logger)
	if err != nil {
		return err
	}
	stopForwarder, err := c.forwardHandoffs(ctx, ob, logger)
	if err != nil {
		return err
	}
	defer stopForwarder()
	// The retry topics as docs/retry.md wires them, with KeyOrder (the
	// soak checks each aggregate's order): its parked-keys check reads the
	// database, which may be refusing connections.
	if err := retry(ctx, "retry-topic middleware", func() error {
		c.rt, err = retrytopic.New(retrytopic.Config{
			Publisher:   tapPublisher{Publisher: pub, c: c},
			Topics:      cfg.RetryTopics,
			PoisonTopic: cfg.PoisonTopic,
			MaxAttempts: retryMaxAttempts,
			Backoff:     retrytopic.Backoff{Initial: retryInitialDelay, Max: retryMaxDelay},
			KeyOrder:    &retrytopic.KeyOrder{DB: c.pool, Outbox: ob, ConsumerGroup: cfg.Group, Table: parkedTable(cfg.Schema)},
		}, logger)
		return err
	}); err != nil {
		return err
	}
	inProcess := middleware.Retry{
		MaxRetries:      cfg.Retries,
		InitialInterval: 10 * time.Millisecond,
		ShouldRetry:     func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) },
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, logger)
	if err != nil {
		return err
	}
	// docs/retry.md's chain, with the soak's reporting middlewares around
	// the retry-topic middleware and around each in-process attempt.
	router.AddMiddleware(c.outer(ctx), c.rt.Middleware, inProcess.Middleware, c.attempt, dedup.Middleware, c.rt.ReleaseMiddleware)
	c.joined = make([]bool, 1+len(cfg.RetryTopics))
	if cfg.Parallel {
		if err := c.addParallelHandlers(ctx, router, logger); err != nil {
			return err
		}
	} else if err := c.addHandlers(router, kc, logger); err != nil {
		return err
	}
	go func() {
		select {
		case <-router.Running():
			c.emit(lineReady)
		case <-ctx.Done():
		}
	}()
	return router.Run(ctx) // until SIGTERM: Close leaves the group, in-flight messages are not acked
}

// addHandlers consumes the main topic and each retry topic with
// watermill-kafka's subscriber.
func (c *child) addHandlers(router *message.Router, kc idemkafka.ClientConfig, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	// The library's default Sarama settings: only the brokers and the group.
	subCfg, err := idemkafka.WatermillSubscriberConfig(kc, cfg.Group)
	if err != nil {
		return err
	}
	subCfg.Tracer = sessionTracer(subCfg.Tracer, c, 0)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("soak-"+cfg.Instance, cfg.Topic, sub, c.handler)
	// A retry consumer per retry topic, each in a Kafka consumer group of
	// its own; the dedup consumer group is the same.
	for i, topic := range cfg.RetryTopics {
		rc, err := idemkafka.WatermillSubscriberConfig(kc, retryGroup(cfg.Group, i))
		if err != nil {
			return err
		}
		rc.Tracer = sessionTracer(retrytopic.HoldingTracer(rc.Tracer), c, 1+i)
		rsub, err := kafka.NewSubscriber(rc, logger)
		if err != nil {
			return err
		}
		router.AddConsumerHandler(fmt.Sprintf("soak-%s-retry%d", cfg.Instance, i+1), topic, rsub, c.handler)
	}
	return nil
}

// addParallelHandlers consumes the main topic and each retry topic with
// idemkafka's parallel subscriber (key order, the library's default Sarama
// settings but for the cooperative-sticky strategy: a rebalance revokes
// only the partitions that move); a retry topic's copies wait in their partition's window until
// their not-before time (retrytopic.RecordNotBefore). A goroutine reports
// each subscriber's first consumer-group session.
func (c *child) addParallelHandlers(ctx context.Context, router *message.Router, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_4_0_0
	sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	base := parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: cfg.Brokers, Sarama: sc}, ConsumerGroup: cfg.Group, MaxInFlight: ParallelMaxInFlight}
	sub, err := parallel.NewSubscriber(base, logger)
	if err != nil {
		return err
	}
	subs := []*parallel.Subscriber{sub}
	router.AddConsumerHandler("soak-"+cfg.Instance, cfg.Topic, sub, c.handler)
	for i, topic := range cfg.RetryTopics {
		rc := base
		rc.ConsumerGroup = retryGroup(cfg.Group, i)
		rc.MaxInFlight = ParallelRetryMaxInFlight
		rc.NotBeforeFunc = retrytopic.RecordNotBefore
		rsub, err := parallel.NewSubscriber(rc, logger)
		if err != nil {
			return err
		}
		subs = append(subs, rsub)
		router.AddConsumerHandler(fmt.Sprintf("soak-%s-retry%d", cfg.Instance, i+1), topic, rsub, c.handler)
	}
	go func() {
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for !c.allJoined.Load() {
			for i, s := range subs {
				if s.Stats().Sessions > 0 {
					c.session(i)
				}
			}
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			}
		}
	}()
	return nil
}

// handoffOutbox is the outbox of KeyOrder's hand-offs: the table of the
// first retry topic.
func handoffOutbox(schema string, retryTopics []string, logger watermill.LoggerAdapter) (*outbox.Outbox, error) {
	return outbox.New(outbox.Config{Schema: schema, Topics: retryTopics[:1]}, logger)
}

// handoffPollInterval is the hand-off forwarders' wait after an empty read:
// a key's next event waits for it at most.
const handoffPollInterval = 10 * time.Millisecond

// forwardHandoffs runs a forwarder of ob on a connection of its own until
// the returned function is called; one that stops on an error (the
// database refusing connections) is started again, as a supervisor would.
func (c *child) forwardHandoffs(ctx context.Context, ob *outbox.Outbox, logger watermill.LoggerAdapter) (stop func(), err error) {
	fpool, err := pgPool(ctx, c.cfg.DatabaseURL, c.cfg.Database, c.cfg.Schema, c.cfg.AppName, 1)
	if err != nil {
		return nil, err
	}
	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: c.cfg.Brokers})
	if err != nil {
		fpool.Close()
		return nil, err
	}
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for fctx.Err() == nil {
			fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{
				DB: fpool, Outbox: ob, Producer: producer,
				PollInterval: handoffPollInterval, RetryInterval: 100 * time.Millisecond,
			}, logger)
			if err == nil {
				err = fwd.Run(fctx)
			}
			if fctx.Err() == nil {
				logger.Info("hand-off forwarder stopped; starting it again", watermill.LogFields{"err": fmt.Sprint(err)})
				select {
				case <-fctx.Done():
				case <-time.After(100 * time.Millisecond):
				}
			}
		}
	}()
	return func() {
		cancel()
		<-done
		_ = producer.Close()
		fpool.Close()
	}, nil
}

// outer sits outside the retry-topic middleware: it reports deliveries,
// applied messages, absorbed duplicates and messages sent along the retry
// path, copies the first group's applied DLQ events to the dead-letter
// topic, and dies after COMMIT when armed.
func (c *child) outer(ctx context.Context) message.HandlerMiddleware {
	return func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			d := &delivery{}
			msg.SetContext(context.WithValue(msg.Context(), stateKey{}, d))
			onRetry := c.isRetryTopic(message.SubscribeTopicFromCtx(msg.Context()))
			if onRetry {
				c.emit(lineDeliveryRetry)
			} else {
				c.emit(lineDelivery)
				n := c.handlers.Add(1)
				defer c.handlers.Add(-1)
				if m := c.maxHandlers.Load(); n > m && c.maxHandlers.CompareAndSwap(m, n) {
					c.emit(lineHandlers + strconv.FormatInt(n, 10))
				}
			}
			produced, err := next(msg)
			switch {
			case err != nil:
				c.emit(lineFailed)
				return nil, err
			case !d.reached:
				// KeyOrder: sent behind its key's parked event, or already
				// on the retry path.
				c.emit(lineDeferred)
				return produced, nil
			case d.err != nil:
				// The retry-topic middleware acked a failure (the handler
				// may have run, its transaction did not commit, or its
				// COMMIT's outcome is unknown): moved to the retry topic of
				// the next attempt, or poisoned.
				if _, poisoned := c.poisoned.LoadAndDelete(msg.UUID); !poisoned {
					attempt, _ := strconv.Atoi(msg.Metadata.Get(retrytopic.MetadataAttempt))
					if !onRetry {
						attempt = 0
					}
					topic := message.SubscribeTopicFromCtx(msg.Context())
					c.emit(lineEscalated + strconv.Itoa(attempt+1) + " " + msg.Metadata.Get(publisher.MetadataEventID) + " " + topic + ": " + oneLine(d.err.Error()))
				}
				return produced, nil
			case d.ran && onRetry:
				c.emit(lineAppliedRetry)
			case d.ran:
				c.emit(lineApplied)
			default:
				c.emit(lineDuplicate)
				return produced, nil
			}
			if c.dlqPub != nil && msg.Metadata.Get(metaDLQ) == "1" {
				// As a dead-letter replay does (poison.Replay): without the
				// retry headers of the copy that was applied.
				m := message.NewMessage(watermill.NewUUID(), msg.Payload)
				for k, v := range msg.Metadata {
					if k != metaDLQ && !retryheaders.Has(k) {
						m.Metadata.Set(k, v)
					}
				}
				if err := retry(ctx, "publish to dlq", func() error { return c.dlqPub.Publish(c.cfg.DLQ, m) }); err == nil {
					c.emit(lineDLQ + msg.Metadata.Get(publisher.MetadataEventID))
				}
			}
			if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillCommit, pendingNone) {
				// COMMIT happened, the ack will not: the next owner gets the
				// message again and must absorb it as a duplicate.
				c.die(faultKillCommit)
			}
			return produced, nil
		}
	}
}

// attempt wraps each in-process attempt (inside watermill's Retry): the
// outer middleware learns whether the chain ran and how its last attempt
// ended.
func (c *child) attempt(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d, _ := msg.Context().Value(stateKey{}).(*delivery)
		if d != nil {
			d.reached, d.ran = true, false
		}
		produced, err := next(msg)
		if d != nil {
			d.err = err
		}
		return produced, err
	}
}

// tapPublisher is the retry-topic middleware's publisher: it reports each
// message published to the poison topic.
type tapPublisher struct {
	message.Publisher
	c *child
}

func (t tapPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := t.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if topic == t.c.cfg.PoisonTopic {
		for _, m := range msgs {
			t.c.poisoned.Store(m.UUID, true)
			t.c.emit(linePoisoned + m.Metadata.Get(publisher.MetadataEventID) + " " + oneLine(m.Metadata.Get(middleware.ReasonForPoisonedKey)))
		}
	}
	return nil
}

// handler applies the event: one ledger row, registered with
// idem.Complete (in transaction mode it is written at once in the
// middleware's transaction; in lease mode in the completing transaction,
// after the handler returned), or, for the broken handler of the checker's
// own test, written through the pool; in lease mode a call to the fake
// provider; then, for an event planned to fail, the call to a downstream
// that is down for it until it has failed as often as planned.
func (c *child) handler(msg *message.Message) error {
	ctx := msg.Context()
	var p payload
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return idem.Permanent(fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err))
	}
	id, _ := idem.EventIDFromContext(ctx)
	d, _ := ctx.Value(stateKey{}).(*delivery)
	ledger := func(ctx context.Context, db interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}) error {
		_, err := db.Exec(ctx, `INSERT INTO soak_ledger (grp, event_id, aggregate, seq, amount, topic, attempt, instance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
			c.cfg.Group, id, p.Aggregate, p.Seq, p.Amount, message.SubscribeTopicFromCtx(ctx), msg.Metadata.Get(retrytopic.MetadataAttempt), c.cfg.Instance)
		return err
	}
	if c.cfg.Unsafe {
		if err := ledger(ctx, c.pool); err != nil {
			return err
		}
	} else if err := idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if err := ledger(ctx, tx); err != nil {
			return err
		}
		if c.cfg.Lease && d != nil {
			d.ran = true // in the completing transaction: the lease was still ours
		}
		return nil
	}); err != nil {
		return err
	}
	if c.cfg.Lease {
		// Lease mode: no transaction, no connection held during the call.
		if err := c.charge(ctx, id, p); err != nil {
			return err
		}
	}
	if p.Fail > 0 {
		// After the ledger row: the failure rolls it back (in lease mode,
		// it is never written).
		if err := c.downstream(ctx, id, p.Fail); err != nil {
			return err
		}
	}
	if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillMid, pendingNone) {
		if c.cfg.Lease {
			// Between the phases: the call returned, the provider charged,
			// the write is registered; the lease is held and nothing is
			// completed. The next delivery takes the lease over once it
			// expires and calls again with the same key.
			c.die(faultKillAfterCall)
		}
		// Inside the transaction: business row written, not committed.
		c.die(faultKillMid)
	}
	if !c.cfg.Lease && d != nil {
		d.ran = true
	}
	return nil
}

// charge calls the fake provider for the event, with its Idempotency-Key
// (the "charge" operation of the group). Armed with a mid-call kill, the
// process dies once the request is sent and the provider is half-way
// through executing it: the charge is made, the lease stays held, and the
// caller never learns the answer.
func (c *child) charge(ctx context.Context, id uuid.UUID, p payload) error {
	body, _ := json.Marshal(chargeRequest{Group: c.cfg.Group, EventID: id.String(), Amount: p.Amount})
	if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillMidCall, pendingNone) {
		wrote := make(chan struct{})
		var once sync.Once
		tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { once.Do(func() { close(wrote) }) }})
		go func() { _ = c.post(tctx, body) }()
		select {
		case <-wrote:
			time.Sleep(callDuration(id) / 2)
		case <-time.After(5 * time.Second):
		}
		c.die(faultKillMidCall)
	}
	return c.post(ctx, body)
}

// post sends one charge request.
func (c *child) post(ctx context.Context, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.ProviderURL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set(headerInstance, c.cfg.Instance)
	if c.cfg.UnstableKey {
		req.Header.Set(idem.IdempotencyKeyHeader, uuid.NewString()) // the transport keeps a key already set
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		return fmt.Errorf("soak: provider: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	switch resp.StatusCode {
	case http.StatusOK:
		return nil
	case http.StatusConflict:
		return errProviderBusy
	}
	return fmt.Errorf("soak: provider: %s", resp.Status)
}

// downstream fails transiently until the event has failed fail times in
// this group. The count is kept in soak_failure, written outside the
// handler's transaction (on downPool), so neither the rollback of the
// failed attempt nor a kill loses it: the plan's failures happen once each,
// on whichever delivery, copy or process comes next.
func (c *child) downstream(ctx context.Context, id uuid.UUID, fail int) error {
	var n int
	err := c.downPool.QueryRow(ctx, `INSERT INTO soak_failure (grp, event_id, failures) VALUES ($1, $2, 1)
ON CONFLICT (grp, event_id) DO UPDATE SET failures = soak_failure.failures + 1 WHERE soak_failure.failures < $3
RETURNING failures`, c.cfg.Group, id, fail).Scan(&n)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil // failed as often as planned: up again
	case err != nil:
		return fmt.Errorf("soak: downstream: %w", err)
	}
	c.emit(lineTransient)
	return fmt.Errorf("soak: downstream unavailable for event %s (planned failure %d of %d)", id, n, fail)
}

// session records that subscriber i's consumer group has set up a session
// (its first JoinGroup and SyncGroup are done), and reports when every
// consumer group of the process has.
func (c *child) session(i int) {
	c.sessMu.Lock()
	defer c.sessMu.Unlock()
	if c.joined[i] {
		return
	}
	c.joined[i] = true
	if !slices.Contains(c.joined, false) {
		c.allJoined.Store(true)
		c.emit(lineJoined)
	}
}

// sessionTracer wraps a subscriber's tracer (nil, or the retry topics'
// HoldingTracer) to see its consumer group's first session start. The
// soak's faults kill a process only once each of its three consumer groups
// has completed its first join: kfake never expires a member killed while
// its first JoinGroup is pending, and the group then stalls until a
// rebalance times out (docs/soak.md, "The consumer-group livelock"). With
// one group per process, "has consumed a message" was enough to tell; with
// three, a process consumes its main topic while a retry group's first
// join may still be pending. Killing a member during that join is the
// crash-loop fault's business.
func sessionTracer(next kafka.SaramaTracer, c *child, i int) kafka.SaramaTracer {
	return handlertracer.New(next, func(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
		return sessionHandler{ConsumerGroupHandler: h, c: c, i: i}
	})
}

type sessionHandler struct {
	sarama.ConsumerGroupHandler
	c *child
	i int
}

func (h sessionHandler) Setup(s sarama.ConsumerGroupSession) error {
	err := h.ConsumerGroupHandler.Setup(s)
	if err == nil {
		h.c.session(h.i)
	}
	return err
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

// errorLogger drops everything below error level: a consumer's stderr
// carries only errors unless the soak runs verbose.
type errorLogger struct{ watermill.LoggerAdapter }

func (l errorLogger) Info(string, watermill.LogFields)  {}
func (l errorLogger) Debug(string, watermill.LogFields) {}
func (l errorLogger) Trace(string, watermill.LogFields) {}
func (l errorLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return errorLogger{l.LoggerAdapter.With(f)}
}

// isRetryTopic reports whether topic is one of the consumer's retry topics.
func (c *child) isRetryTopic(topic string) bool { return slices.Contains(c.cfg.RetryTopics, topic) }

// dumpGoroutinesOnSIGUSR1 writes every goroutine's stack to
// $TMPDIR/soak-goroutines-<instance>-<pid>.txt each time the process gets
// SIGUSR1, and goes on: how the soak's stuck log (and an operator, with
// kill -USR1) sees what a live consumer waits for.
func dumpGoroutinesOnSIGUSR1(instance string) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	go func() {
		for range ch {
			path := filepath.Join(os.TempDir(), fmt.Sprintf("soak-goroutines-%s-%d.txt", instance, os.Getpid()))
			f, err := os.Create(path)
			if err != nil {
				fmt.Fprintf(os.Stderr, "soak consumer %s: goroutine dump: %v\n", instance, err)
				continue
			}
			_ = pprof.Lookup("goroutine").WriteTo(f, 2)
			_ = f.Close()
			fmt.Fprintf(os.Stderr, "soak consumer %s: goroutines written to %s\n", instance, path)
		}
	}()
}
