package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// demoConfig sizes the demo and its injected faults.
type demoConfig struct {
	// DatabaseURL of the PostgreSQL server; the demo creates its own schema
	// and drops it at the end.
	DatabaseURL string
	// Brokers of a Kafka cluster; nil starts an in-process Kafka-protocol
	// broker (kfake). With a real cluster, topic and group names get a
	// per-run suffix.
	Brokers []string
	// Orders to confirm in phase 1.
	Orders int
	// Partitions of orders.confirmed.
	Partitions int32
	// BillingInstances: billing consumers in the same group (partitions are
	// split between them, as between pods).
	BillingInstances int
	// BillingInFlight is the MaxInFlight of each billing instance's
	// parallel subscriber (idemkafka): the charges running at once per
	// instance, each holding a database connection. Defaults to 16.
	BillingInFlight int
	// RedeliverEvery: every n-th order's event is published a second time
	// with the same event id, as a producer retry or a forwarder resend after
	// a crash would. 0 disables.
	RedeliverEvery int
	// ConcurrentDuplicates: events whose copies are published on every
	// partition at once, so consumers claim the same event id concurrently.
	ConcurrentDuplicates int
	// LostResponses: orders whose charge response the provider loses after
	// charging.
	LostResponses int
	// ProviderLatency is how long a charge takes.
	ProviderLatency time.Duration
	// ConcurrentLatency is how long the charges of the ConcurrentDuplicates
	// orders take: the window in which their copies meet.
	ConcurrentLatency time.Duration
	// LeaseConcurrency is billing's idem.LeaseConfig.Concurrency: its pool
	// holds 2 × LeaseConcurrency + 1 connections. Defaults to 4.
	LeaseConcurrency int
	// LeaseDuration is billing's idem.LeaseConfig.Duration (renewed every
	// third of it): how long a crashed billing process's event waits before
	// another instance takes it over. Defaults to 3 s.
	LeaseDuration time.Duration
	// SlowOrders: orders confirmed during the provider slowdown (phase 2),
	// each charge taking SlowLatency to SlowLatency + 1 s. 0 skips the
	// phase.
	SlowOrders int
	// SlowLatency is the shortest charge of the slowdown. Defaults to 1 s.
	SlowLatency time.Duration
	// IdleInTxLimit: a demo session idle in a transaction for longer than
	// this at any sample of the slowdown is a violation; 0 reports the
	// longest without checking it.
	IdleInTxLimit time.Duration
	// CrashAndTakeover runs phase 3: a billing process SIGKILLed between
	// its call and its completion, and a lease taken over while its first
	// owner is frozen in its call. It needs Partitions >= BillingInstances
	// + 2.
	CrashAndTakeover bool
	// Timeout bounds the whole run: a deadline for when something is stuck,
	// not an expected duration. Defaults to 5 minutes.
	Timeout time.Duration
	// Progress receives progress lines; nil for none.
	Progress io.Writer
	// Logger for the library and Watermill; nil for none.
	Logger watermill.LoggerAdapter

	// billingTxMode runs billing in transaction mode (no Lease): its
	// transaction stays open across the provider call (tests: the
	// idle-in-transaction check must catch it).
	billingTxMode bool
	// childVerbose makes the child processes log to their standard error.
	childVerbose bool
	// providerIgnoresKeys makes the payment provider charge every request,
	// whatever its Idempotency-Key (tests: the invariants must catch it).
	providerIgnoresKeys bool
}

func (c *demoConfig) setDefaults() {
	if c.Orders == 0 {
		c.Orders = 200
	}
	if c.Partitions == 0 {
		c.Partitions = 4
	}
	if c.BillingInstances == 0 {
		c.BillingInstances = 2
	}
	if c.BillingInFlight == 0 {
		c.BillingInFlight = 16
	}
	if c.ConcurrentLatency == 0 {
		c.ConcurrentLatency = 100 * time.Millisecond
	}
	if c.LeaseConcurrency == 0 {
		c.LeaseConcurrency = 4
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = 3 * time.Second
	}
	if c.SlowLatency == 0 {
		c.SlowLatency = time.Second
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// billingConns is the size of billing's pool: 2 × Lease.Concurrency + 1 in
// lease mode, one per charge in flight in transaction mode.
func (d *demo) billingConns() int {
	if d.cfg.billingTxMode {
		return d.cfg.BillingInstances * d.cfg.BillingInFlight
	}
	return 2*d.cfg.LeaseConcurrency + 1
}

// leaseRenew is billing's Lease.RenewInterval.
func (c demoConfig) leaseRenew() time.Duration { return c.LeaseDuration / 3 }

// names are the topics and groups of one run.
type names struct {
	orders, charged, poison  string
	billing, notification    string
	auditPoison, auditCharge string
}

func newNames(suffix string) names {
	return names{
		orders: TopicOrdersConfirmed + suffix, charged: TopicBillingCharged + suffix, poison: TopicPoison + suffix,
		billing: GroupBilling + suffix, notification: GroupNotification + suffix,
		auditPoison: "demo-audit-poison" + suffix, auditCharge: "demo-audit-charged" + suffix,
	}
}

// demo is one run: what it opened (closed in reverse order by close), the
// services it started, the orders it confirmed and its report.
type demo struct {
	cfg     demoConfig
	started time.Time
	rep     *report
	closers []func() error

	n      names
	suffix string // of topic and group names: a per-run one on a real cluster
	table  deduplicator.TableConfig
	ob     *outbox.Outbox
	orders []Order

	// pool serves notification, the order service and the demo's queries;
	// billingPool billing's dedup middleware; fwdPool the forwarder.
	pool, billingPool, fwdPool *pgxpool.Pool

	brokers  []string
	kafkaPub message.Publisher // poison queue and injected copies
	partPub  message.Publisher // copies on a chosen partition
	producer sarama.SyncProducer
	kclient  sarama.Client // counts the records on orders.confirmed

	// spans receives the spans of every service: each has a TracerProvider
	// of its own (its service.name), as in a process of its own.
	spans     *tracetest.InMemoryExporter
	providers map[string]*sdktrace.TracerProvider
	// traced is the order whose trace the report shows: its provider
	// response is lost once and its event is published twice.
	traced      int
	tracedTrace trace.TraceID

	provider     *paymentProvider
	fwd          *outbox.Forwarder
	billing      *consumer
	notification *consumer
	audit        *auditor

	bg      *errgroup.Group
	bgCtx   context.Context // cancelled when a background service fails
	stopBG  context.Context // bgCtx, also cancelled by stopAll
	stopAll context.CancelFunc
}

// consumer is one consumer group: its router (one handler per instance), its
// dedup middleware and what its handler chain counted.
type consumer struct {
	router *message.Router
	dedup  *idem.Dedup
	stats  *groupStats
}

// runDemo runs the whole scenario and returns its report; Violations lists
// every broken invariant. An error means the demo could not run at all.
func runDemo(ctx context.Context, cfg demoConfig) (rep *report, err error) {
	cfg.setDefaults()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	d := &demo{cfg: cfg, started: time.Now(), rep: &report{}}
	defer func() {
		if cerr := d.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()

	if err := d.openPostgres(ctx); err != nil {
		return nil, err
	}
	d.openTracing()
	if err := d.openKafka(); err != nil {
		return nil, err
	}
	if err := d.migrate(ctx); err != nil {
		return nil, err
	}
	if err := d.startServices(ctx); err != nil {
		return nil, err
	}
	if err := d.phase1(ctx); err != nil {
		return nil, fmt.Errorf("phase 1: %w", err)
	}
	if err := d.phaseSlowdown(ctx); err != nil {
		return nil, fmt.Errorf("phase 2: %w", err)
	}
	if err := d.phaseCrash(ctx); err != nil {
		return nil, fmt.Errorf("phase 3: %w", err)
	}
	if err := d.phase4(ctx); err != nil {
		return nil, fmt.Errorf("phase 4: %w", err)
	}
	if err := d.stopServices(ctx); err != nil {
		return nil, err
	}
	d.collect(ctx)
	d.checkInvariants(ctx)
	d.pruneOutbox(ctx)
	d.rep.Elapsed = time.Since(d.started)
	return d.rep, nil
}

func (d *demo) progress(format string, args ...any) {
	fmt.Fprintf(d.cfg.Progress, "[%5.1fs] "+format+"\n", append([]any{time.Since(d.started).Seconds()}, args...)...)
}

// onClose registers f to run when the demo ends, before what was registered
// earlier.
func (d *demo) onClose(f func() error) { d.closers = append(d.closers, f) }

// close stops the background services (if an early return left them
// running), then closes everything in reverse order of opening.
func (d *demo) close() error {
	if d.stopAll != nil {
		d.stopAll()
		_ = d.bg.Wait()
	}
	var err error
	for i := len(d.closers) - 1; i >= 0; i-- {
		err = errors.Join(err, d.closers[i]())
	}
	return err
}

// openPostgres creates a fresh schema, dropped at the end.
func (d *demo) openPostgres(ctx context.Context) error {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	runID := hex.EncodeToString(rnd[:])
	schema := "billing_demo_" + runID
	if err := createSchema(ctx, d.cfg.DatabaseURL, schema); err != nil {
		return err
	}
	d.onClose(func() error { return dropSchema(d.cfg.DatabaseURL, schema) })
	d.table = deduplicator.TableConfig{Schema: schema}
	// A pool per service that holds transactions, as in processes of their
	// own; application_name tells their sessions apart (the slowdown's
	// idle-in-transaction sampler reports by it). The main pool serves
	// notification (a transaction per partition in flight), the order
	// service (4 at once) and the demo's own queries; billing's lease mode
	// needs 2 × Lease.Concurrency + 1, whatever its charges in flight; the
	// forwarder one per topic.
	pools := []struct {
		p    **pgxpool.Pool
		app  string
		size int
	}{
		{&d.pool, schema, int(d.cfg.Partitions) + 5},
		{&d.billingPool, schema + "/" + serviceBilling, d.billingConns()},
		{&d.fwdPool, schema + "/" + serviceForwarder, 3},
	}
	for _, p := range pools {
		pool, err := openPool(ctx, d.cfg.DatabaseURL, schema, p.app, int32(p.size))
		if err != nil {
			return err
		}
		*p.p = pool
		d.onClose(func() error { pool.Close(); return nil })
	}
	d.progress("PostgreSQL: schema %s", schema)

	// Names: with a real cluster, topics and groups are per run too.
	if len(d.cfg.Brokers) > 0 {
		d.suffix = "." + runID
	}
	d.n = newNames(d.suffix)
	return nil
}

// Service names: the service.name of each service's TracerProvider.
const (
	serviceOrders       = "order-service"
	serviceBilling      = "billing"
	serviceNotification = "notification"
	serviceForwarder    = "outbox-forwarder"
)

// openTracing gives each service an SDK TracerProvider of its own, named by
// its resource's service.name, all exporting synchronously to one in-memory
// exporter: the report prints one order's trace from it.
func (d *demo) openTracing() {
	d.spans = tracetest.NewInMemoryExporter()
	d.providers = map[string]*sdktrace.TracerProvider{}
	for _, name := range []string{serviceOrders, serviceBilling, serviceNotification, serviceForwarder} {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(d.spans),
			sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", name))))
		d.providers[name] = tp
		d.onClose(func() error { return tp.Shutdown(context.Background()) })
	}
}

// openKafka starts kfake (unless Brokers is set), creates the topics and
// opens the Kafka clients.
func (d *demo) openKafka() error {
	d.brokers = d.cfg.Brokers
	if len(d.brokers) == 0 {
		fake, err := kafkatest.NewFake()
		if err != nil {
			return fmt.Errorf("start kfake: %w", err)
		}
		d.onClose(func() error { fake.Close(); return nil })
		d.brokers = fake.ListenAddrs()
		d.progress("Kafka: in-process kfake broker on %s", d.brokers[0])
	} else {
		d.progress("Kafka: %v (topics and groups suffixed %q)", d.brokers, d.suffix)
	}
	for _, t := range []struct {
		name string
		p    int32
	}{{d.n.orders, d.cfg.Partitions}, {d.n.charged, 1}, {d.n.poison, 1}} {
		if err := kafkatest.CreateTopic(d.brokers, t.name, t.p); err != nil {
			return fmt.Errorf("create topic %s: %w", t.name, err)
		}
	}

	kcfg := idemkafka.ClientConfig{Brokers: d.brokers}
	pubCfg, err := idemkafka.WatermillPublisherConfig(kcfg)
	if err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, d.cfg.Logger)
	if err != nil {
		return fmt.Errorf("kafka publisher: %w", err)
	}
	d.kafkaPub = kafkaPub
	d.onClose(ignoreError(kafkaPub.Close))

	manual := sarama.NewConfig()
	manual.Producer.Partitioner = sarama.NewManualPartitioner
	partPub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: d.brokers, Marshaler: partitionMarshaler{}, OverwriteSaramaConfig: idemkafka.SaramaProducerConfig(manual),
	}, d.cfg.Logger)
	if err != nil {
		return fmt.Errorf("kafka publisher: %w", err)
	}
	d.partPub = partPub
	d.onClose(ignoreError(partPub.Close))

	if d.producer, err = idemkafka.NewSyncProducer(kcfg); err != nil {
		return fmt.Errorf("kafka producer: %w", err)
	}
	d.onClose(ignoreError(d.producer.Close))

	if d.kclient, err = sarama.NewClient(d.brokers, idemkafka.SaramaConsumerConfig(nil)); err != nil {
		return fmt.Errorf("kafka client: %w", err)
	}
	d.onClose(ignoreError(d.kclient.Close))
	return nil
}

// migrate creates the dedup table, the outbox tables and the business
// tables. Migrations run before NewDedup, which may verify the table.
func (d *demo) migrate(ctx context.Context) error {
	if err := migrate.Up(ctx, d.pool, deduplicator.MigrationLine(d.table)); err != nil {
		return fmt.Errorf("migrate processed_event: %w", err)
	}
	ob, err := outbox.New(outbox.Config{Schema: d.table.Schema, Topics: []string{d.n.orders, d.n.charged}}, d.cfg.Logger)
	if err != nil {
		return err
	}
	if err := migrate.Up(ctx, d.pool, outbox.MigrationLine(ob.Config(), d.n.orders), outbox.MigrationLine(ob.Config(), d.n.charged)); err != nil {
		return fmt.Errorf("migrate outbox: %w", err)
	}
	d.ob = ob
	if _, err := d.pool.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	return nil
}

// startServices starts the payment provider, the outbox forwarder, the
// billing and notification consumers and the auditors, and waits until the
// routers run.
func (d *demo) startServices(ctx context.Context) error {
	p, err := newPaymentProvider(d.cfg.ProviderLatency)
	if err != nil {
		return err
	}
	p.ignoreKeys = d.cfg.providerIgnoresKeys
	d.provider = p
	d.onClose(ignoreError(p.Close))
	d.progress("payment provider on %s", p.URL())

	d.bg, d.bgCtx = errgroup.WithContext(ctx)
	d.stopBG, d.stopAll = context.WithCancel(d.bgCtx)

	d.fwd, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: d.fwdPool, Outbox: d.ob, Producer: d.producer, PollInterval: 20 * time.Millisecond,
		TracerProvider: d.providers[serviceForwarder]}, d.cfg.Logger)
	if err != nil {
		return err
	}
	d.bg.Go(func() error { return d.fwd.Run(d.stopBG) })

	poison, err := wmw.PoisonQueueWithFilter(d.kafkaPub, d.n.poison, idem.IsPermanent)
	if err != nil {
		return err
	}
	billingCfg := idem.Config{DB: d.billingPool, ConsumerGroup: d.n.billing, Table: d.table, Outbox: d.ob, TracerProvider: d.providers[serviceBilling],
		Concurrency: d.cfg.BillingInstances * d.cfg.BillingInFlight,
		Lease: &idem.LeaseConfig{Duration: d.cfg.LeaseDuration, RenewInterval: d.cfg.leaseRenew(), Concurrency: d.cfg.LeaseConcurrency,
			Owner: fmt.Sprintf("billing (demo, pid %d)", os.Getpid())}}
	if d.cfg.billingTxMode {
		billingCfg.Lease = nil
	}
	billingSvc := NewBillingService(p.URL())
	// Billing runs in lease mode: its provider call holds no transaction
	// and no connection, so its pool does not grow with the charges in
	// flight (2 × Lease.Concurrency + 1 connections for any MaxInFlight).
	d.billing, err = d.newConsumer("billing", d.cfg.BillingInstances, d.newParallelSubscriber, poison, billingCfg,
		func(r *message.Router, handler string, sub message.Subscriber) *message.Handler {
			// The router closes each handler's publisher on shutdown; the
			// handlers share kafkaPub (closed at the end), so each gets a view
			// whose Close does nothing: watermill-kafka's Close is not safe
			// to call twice concurrently.
			return r.AddHandler(handler, d.n.orders, sub, d.n.charged, sharedPublisher{d.kafkaPub}, billingSvc.Handle)
		})
	if err != nil {
		return err
	}
	d.notification, err = d.newConsumer("notification", 1, d.newWatermillSubscriber, poison,
		idem.Config{DB: d.pool, ConsumerGroup: d.n.notification, Table: d.table, TracerProvider: d.providers[serviceNotification]},
		func(r *message.Router, handler string, sub message.Subscriber) *message.Handler {
			return r.AddConsumerHandler(handler, d.n.orders, sub, NotificationService{}.Handle)
		})
	if err != nil {
		return err
	}
	if err := d.startAuditors(); err != nil {
		return err
	}

	routers := []*message.Router{d.billing.router, d.notification.router}
	for _, r := range routers {
		d.bg.Go(func() error { return r.Run(d.stopBG) })
	}
	for _, r := range routers {
		select {
		case <-r.Running():
		case <-ctx.Done():
			return fmt.Errorf("routers did not start: %w", ctx.Err())
		}
	}
	d.progress("billing (%d instances, group %s) and notification (group %s) running", d.cfg.BillingInstances, d.n.billing, d.n.notification)
	return nil
}

// newConsumer builds one consumer group: a router with one handler per
// instance (each with its own subscriber in the group), every handler behind
// PoisonQueue → counting wrapper → dedup middleware → marker.
func (d *demo) newConsumer(service string, instances int, newSub func(group string) (message.Subscriber, error), poison message.HandlerMiddleware, cfg idem.Config,
	add func(r *message.Router, handler string, sub message.Subscriber) *message.Handler,
) (*consumer, error) {
	// CloseTimeout is a deadline for a busy machine, not an expected
	// duration: closing waits for in-flight handlers and for Sarama to leave
	// the consumer group.
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, d.cfg.Logger)
	if err != nil {
		return nil, err
	}
	dedup, err := idem.NewDedup(cfg, d.cfg.Logger)
	if err != nil {
		return nil, err
	}
	c := &consumer{router: r, dedup: dedup, stats: &groupStats{dedup: dedup}}
	for i := 1; i <= instances; i++ {
		sub, err := newSub(cfg.ConsumerGroup)
		if err != nil {
			return nil, err
		}
		// The handler name starts with the service: the poison topic's
		// handler_poisoned metadata tells the auditor whose rejection it is.
		h := add(r, service+"-"+strconv.Itoa(i), sub)
		h.AddMiddleware(poison, c.stats.outer, dedup.Middleware, inner)
	}
	return c, nil
}

// newParallelSubscriber is billing's subscriber: idemkafka/parallel's, which keeps
// BillingInFlight charges in flight per instance, ordered by order key.
func (d *demo) newParallelSubscriber(group string) (message.Subscriber, error) {
	return parallel.NewSubscriber(parallel.SubscriberConfig{
		Client:              idemkafka.ClientConfig{Brokers: d.brokers},
		ConsumerGroup:       group,
		MaxInFlight:         d.cfg.BillingInFlight,
		NackResendSleep:     20 * time.Millisecond,
		ReconnectRetrySleep: 100 * time.Millisecond,
	}, d.cfg.Logger)
}

func (d *demo) newWatermillSubscriber(group string) (message.Subscriber, error) {
	return d.newSubscriber(group)
}

func (d *demo) newSubscriber(group string) (*kafka.Subscriber, error) {
	sc, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: d.brokers}, group)
	if err != nil {
		return nil, err
	}
	sc.NackResendSleep = 20 * time.Millisecond
	sc.ReconnectRetrySleep = 100 * time.Millisecond
	return kafka.NewSubscriber(sc, d.cfg.Logger)
}

// startAuditors consumes the poison topic and billing.charged in groups of
// their own, to check what reached them.
func (d *demo) startAuditors() error {
	d.audit = newAuditor()
	for _, a := range []struct{ group, topic string }{{d.n.auditPoison, d.n.poison}, {d.n.auditCharge, d.n.charged}} {
		sub, err := d.newSubscriber(a.group)
		if err != nil {
			return err
		}
		ch, err := sub.Subscribe(d.stopBG, a.topic)
		if err != nil {
			_ = sub.Close()
			return fmt.Errorf("subscribe %s: %w", a.topic, err)
		}
		poison := a.topic == d.n.poison
		d.bg.Go(func() error {
			defer sub.Close()
			for msg := range ch {
				d.audit.record(poison, msg)
				msg.Ack()
			}
			return nil
		})
	}
	return nil
}

// stopServices closes the consumers, so that their counts are final, then
// the auditors and the forwarder. Closing one billing instance hands its
// partitions to the other, which may receive records again whose offsets
// were not committed yet: they are counted like any other delivery.
func (d *demo) stopServices(ctx context.Context) error {
	for _, r := range []*message.Router{d.billing.router, d.notification.router} {
		if err := r.Close(); err != nil {
			return fmt.Errorf("close router: %w", err)
		}
	}
	// Every rejection published one poison record: wait until the auditor
	// has read them all.
	if err := d.waitFor(ctx, "shutdown", func() bool {
		return d.audit.poisoned("billing") >= int(d.billing.stats.rejected.Load()) &&
			d.audit.poisoned("notification") >= int(d.notification.stats.rejected.Load())
	}); err != nil {
		return err
	}
	d.stopAll()
	_ = d.fwd.Close()
	if err := d.bg.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("background: %w", err)
	}
	return nil
}

// pruneOutbox deletes what the forwarder has sent with
// outbox.DeleteForwarded: the forwarder never prunes the outbox tables
// (docs/operations.md).
func (d *demo) pruneOutbox(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for _, topic := range []string{d.n.orders, d.n.charged} {
		total := d.count(ctx, `SELECT count(*) FROM `+d.ob.MessagesTable(topic))
		pruned, err := d.ob.DeleteForwarded(ctx, d.pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}})
		if err != nil {
			d.rep.Violations = append(d.rep.Violations, err.Error())
			continue
		}
		d.rep.OutboxPruned += pruned
		d.check(pruned == int64(total), "outbox %s: pruned %d of %d forwarded rows", topic, pruned, total)
	}
}

// count runs a count query; a failure is a violation.
func (d *demo) count(ctx context.Context, q string, args ...any) int {
	var v int
	if err := d.pool.QueryRow(ctx, q, args...).Scan(&v); err != nil {
		d.rep.Violations = append(d.rep.Violations, fmt.Sprintf("query %q: %v", q, err))
	}
	return v
}

// check records a violation unless ok.
func (d *demo) check(ok bool, format string, args ...any) {
	if !ok {
		d.rep.Violations = append(d.rep.Violations, fmt.Sprintf(format, args...))
	}
}

// topicRecords returns the number of records on topic: the sum over its
// partitions of the newest minus the oldest offset.
func topicRecords(client sarama.Client, topic string) (int, error) {
	if err := client.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	n := int64(0)
	for _, p := range parts {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return 0, err
		}
		n += newest - oldest
	}
	return int(n), nil
}

func createSchema(ctx context.Context, url, schema string) error {
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL at %s: %w (set DATABASE_URL)", url, err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	return nil
}

// openPool opens a pool on schema whose sessions are named app
// (application_name). A claim's winner never needs a second connection,
// so claims waiting on it cannot starve it.
func openPool(ctx context.Context, url, schema, app string, maxConns int32) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pcfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, pcfg)
}

func dropSchema(url, schema string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("drop schema: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", schema, err)
	}
	return nil
}

// sharedPublisher lends a publisher to a router handler without letting the
// router close it.
type sharedPublisher struct{ message.Publisher }

func (sharedPublisher) Close() error { return nil }

func ignoreError(f func() error) func() error {
	return func() error { _ = f(); return nil }
}
