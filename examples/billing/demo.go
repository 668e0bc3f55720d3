package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
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

// billingConns is the size of billing's pool: 2 × LeaseConfig.Concurrency + 1 in
// lease mode, one per charge in flight in transaction mode.
func (d *demo) billingConns() int {
	if d.cfg.billingTxMode {
		return d.cfg.BillingInstances * d.cfg.BillingInFlight
	}
	return 2*d.cfg.LeaseConcurrency + 1
}

// leaseRenew is billing's LeaseConfig.RenewInterval.
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

// Service names: the service.name of each service's TracerProvider.
const (
	serviceOrders       = "order-service"
	serviceBilling      = "billing"
	serviceNotification = "notification"
	serviceForwarder    = "outbox-forwarder"
)

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

// sharedPublisher lends a publisher to a router handler without letting the
// router close it.
type sharedPublisher struct{ message.Publisher }

func (sharedPublisher) Close() error { return nil }

func ignoreError(f func() error) func() error {
	return func() error { _ = f(); return nil }
}
