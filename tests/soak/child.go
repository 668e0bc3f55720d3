package soak

import (
	"bufio"
	"context"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/childproc"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
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
func RunConsumerIfChild() { childproc.RunIfSet(ConsumerEnv, "soak consumer", runConsumer) }

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
	// The franz-go engine ([Config.Engine]): its Subscriber on every
	// topic, on GroupProtocol; with Share, the main topic as a member of
	// a share group (no retry topics).
	Engine        string `json:"engine"`
	GroupProtocol string `json:"group_protocol"`
	// InstanceID makes the franz subscribers static members (Config.Static).
	InstanceID string `json:"instance_id,omitempty"`
	Share      bool   `json:"share"`
	// Lease mode (idem.Config.Mode = &idem.LeaseConfig{}): the lease's duration, and the fake
	// provider the handler calls (docs/soak.md, "The lease-mode leg").
	Lease         bool          `json:"lease"`
	LeaseDuration time.Duration `json:"lease_duration"`
	ProviderURL   string        `json:"provider_url"`
	UnstableKey   bool          `json:"unstable_key"` // a new Idempotency-Key per call: the checker's own test
	// Hostile keys ([Config.HostileKeys]): the failing key, whose messages
	// skip the retry-topic middleware (their failures are nacked), and the
	// main topic subscriber's PartitionWindow (0: its default).
	FailingKey      string `json:"failing_key"`
	PartitionWindow int    `json:"partition_window"`
	// The failover fault's runs ([FaultCounts.Failover]): the parallel
	// subscribers use the (eager) sticky strategy and, with Progress,
	// start each partition from PostgreSQL's position; SkipProgress keeps
	// the position in Kafka only (the run that shows the loss).
	Sticky       bool `json:"sticky"`
	Progress     bool `json:"progress"`
	SkipProgress bool `json:"skip_progress"`
	// KeepsPosition: watermill-kafka's subscribers keep the positions
	// themselves ([Config.SubscriberProgress]).
	KeepsPosition bool `json:"keeps_position"`
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
	lineSpilled       = "sp " // + n: a new high of spilled records in the main topic's parallel subscriber
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
	go c.readCommands(stop)
	logger := childLogger(cfg)

	closePools, err := c.openPools(ctx)
	if err != nil {
		return err
	}
	defer closePools()
	dedup, err := c.newDedup(ctx, logger)
	if err != nil {
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
	if cfg.Share {
		c.joined = make([]bool, 1)
		return c.runShare(ctx, dedup, pub, logger)
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
	if err := c.newRetryTopic(ctx, pub, ob, logger); err != nil {
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
	router.AddMiddleware(c.outer(ctx), c.retryPath(inProcess.Middleware, c.attempt, dedup.Middleware, c.rt.ReleaseMiddleware))
	c.joined = make([]bool, 1+len(cfg.RetryTopics))
	switch {
	case cfg.Engine == EngineFranz:
		err = c.addFranzHandlers(router, logger)
	case cfg.Parallel:
		err = c.addParallelHandlers(ctx, router, logger)
	default:
		err = c.addHandlers(router, kc, logger)
	}
	if err != nil {
		return err
	}
	return c.runRouter(ctx, router)
}

// readCommands arms the kills the soak writes to the process's input,
// and calls stop when the soak closed it or is gone.
func (c *child) readCommands(stop func()) {
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
}

// childLogger is the process's logger: errors only unless Verbose (then
// Sarama's log too), each line naming the instance.
func childLogger(cfg childConfig) watermill.LoggerAdapter {
	var logger watermill.LoggerAdapter = errorLogger{watermill.NewStdLoggerWithOut(os.Stderr, false, false)}
	if cfg.Verbose {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, false, false)
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.LstdFlags|log.Lmicroseconds)
	}
	return logger.With(watermill.LogFields{"instance": cfg.Instance})
}

// openPools opens the process's pools: the middleware's and the small one
// of the "downstream", and returns how to close them.
func (c *child) openPools(ctx context.Context) (closePools func(), err error) {
	cfg := c.cfg
	if c.pool, err = pgPool(ctx, cfg.DatabaseURL, cfg.Database, cfg.Schema, cfg.AppName, cfg.MaxConns); err != nil {
		return nil, err
	}
	if c.downPool, err = pgPool(ctx, cfg.DatabaseURL, cfg.Database, cfg.Schema, cfg.AppName, 2); err != nil {
		c.pool.Close()
		return nil, err
	}
	return func() { c.downPool.Close(); c.pool.Close() }, nil
}

// newDedup is the dedup middleware in the run's mode. The database may be
// refusing connections (a disruption): it retries.
func (c *child) newDedup(ctx context.Context, logger watermill.LoggerAdapter) (dedup *idem.Dedup, err error) {
	cfg := c.cfg
	err = retry(ctx, "dedup middleware", func() error {
		dcfg := idem.Config{DB: c.pool, ConsumerGroup: cfg.Group, Table: tableConfig(cfg.Schema), SkipProgress: cfg.SkipProgress}
		for i := range cfg.RetryTopics {
			// watermill-kafka's retry subscribers: their claims' starts are
			// the partitions' first positions (a failover keeps them).
			dcfg.KafkaGroups = append(dcfg.KafkaGroups, retryGroup(cfg.Group, i))
		}
		if cfg.Parallel || cfg.Engine == EngineFranz {
			// Every topic's subscriber hands out up to its MaxInFlight
			// messages at once.
			dcfg.Concurrency = ParallelMaxInFlight + len(cfg.RetryTopics)*ParallelRetryMaxInFlight
		}
		if cfg.GroupCommit {
			dcfg.Mode = &idem.GroupCommitConfig{}
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
			dcfg.Mode = &idem.LeaseConfig{Duration: cfg.LeaseDuration, Concurrency: 1, Owner: cfg.Instance, FastPath: -1}
		}
		dedup, err = idem.NewDedup(dcfg, logger)
		return err
	})
	return dedup, err
}

// newRetryTopic sets c.rt: the retry topics as docs/retry.md wires them,
// publishing on pub, with KeyOrder (the soak checks each aggregate's
// order) handing keys on through ob. Its parked-keys check reads the
// database, which may be refusing connections: it retries.
func (c *child) newRetryTopic(ctx context.Context, pub message.Publisher, ob *outbox.Outbox, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	return retry(ctx, "retry-topic middleware", func() error {
		var err error
		c.rt, err = retrytopic.New(retrytopic.Config{
			Publisher:   tapPublisher{Publisher: pub, c: c},
			Topics:      cfg.RetryTopics,
			PoisonTopic: cfg.PoisonTopic,
			MaxAttempts: retryMaxAttempts,
			Backoff:     retrytopic.Backoff{Initial: retryInitialDelay, Max: retryMaxDelay},
			KeyOrder:    &retrytopic.KeyOrder{DB: c.pool, Outbox: ob, ConsumerGroup: cfg.Group, Table: parkedTable(cfg.Schema)},
		}, logger)
		return err
	})
}

// addHandlers consumes the main topic and each retry topic with
// watermill-kafka's subscriber.
func (c *child) addHandlers(router *message.Router, kc idemkafka.ClientConfig, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	if cfg.KeepsPosition {
		kc.Progress, kc.ProgressSchema = c.pool, cfg.Schema
	}
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
// only the partitions that move; in a run with the failover fault the
// eager sticky one, which Progress needs); a retry topic's copies wait in their partition's window until
// their not-before time (retrytopic.RecordNotBefore). With hostile keys the
// main topic's PartitionWindow is small, and a goroutine reports its
// spills. A goroutine reports each subscriber's first consumer-group
// session.
func (c *child) addParallelHandlers(ctx context.Context, router *message.Router, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_4_0_0
	sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	if cfg.Sticky {
		sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategySticky()}
	}
	base := parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: cfg.Brokers, Sarama: sc}, ConsumerGroup: cfg.Group, MaxInFlight: ParallelMaxInFlight}
	if cfg.Progress {
		base.Progress, base.ProgressSchema = c.pool, cfg.Schema
	}
	mc := base
	mc.PartitionWindow = cfg.PartitionWindow // hostile keys: small, so that it fills and spills
	sub, err := parallel.NewSubscriber(mc, logger)
	if err != nil {
		return err
	}
	go c.watchSpill(ctx, sub)
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
