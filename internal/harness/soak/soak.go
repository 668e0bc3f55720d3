package soak

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// Defaults of [Config].
const (
	DefaultEvents          = 20000
	DefaultAggregates      = 64
	DefaultPartitions      = 6
	DefaultInstances       = 3
	DefaultSecondInstances = 2
	DefaultProducers       = 8
	DefaultDLQPercent      = 10
	DefaultDoublePercent   = 2
	DefaultTimeout         = 15 * time.Minute
	DefaultOutage          = 3 * time.Second
)

// Config of a soak run.
type Config struct {
	// Seed drives the event plan (aggregate, sequence, amount, which events
	// are replayed from the DLQ or published twice) and the fault schedule.
	// Timing is not reproducible (goroutines, broker), the plan is.
	Seed uint64
	// Events to produce. Defaults to [DefaultEvents].
	Events int
	// Aggregates the events are spread over; one aggregate's events share a
	// partition key. Defaults to [DefaultAggregates].
	Aggregates int
	// Partitions of the topic. Defaults to [DefaultPartitions].
	Partitions int32
	// Instances of the first consumer group's router. Defaults to [DefaultInstances].
	Instances int
	// SecondInstances of the second consumer group. Defaults to [DefaultSecondInstances].
	SecondInstances int
	// Producers are concurrent producer workers; each owns a subset of the
	// aggregates and produces their events in order. Defaults to [DefaultProducers].
	Producers int
	// DLQPercent of the events are copied to a dead-letter topic after the
	// first group applied them, and replayed from there to the main topic.
	// Defaults to [DefaultDLQPercent]; negative means none.
	DLQPercent int
	// DoublePercent of the events are published a second time, concurrently
	// with the first. Defaults to [DefaultDoublePercent]; negative means none.
	DoublePercent int
	// Faults is how many of each fault kind to inject (offset resets: per
	// group, at most 1 by default). Defaults to [FullFaults].
	Faults FaultCounts
	// DirectPublish makes the producer publish to Kafka after committing
	// the business row, instead of writing the outbox in the same
	// transaction for the forwarder. Defaults to false (outbox + forwarder).
	DirectPublish bool
	// UnsafeLedgerOutsideTx makes the handler write its ledger row through
	// the instance's pool instead of the middleware's transaction: a broken
	// handler, to check that the soak catches double application. Defaults
	// to false.
	UnsafeLedgerOutsideTx bool
	// GroupCommit runs the consumers in group-commit mode
	// (idem.Config.GroupCommit with its defaults). Defaults to false: one
	// transaction per message.
	GroupCommit bool
	// Timeout bounds the whole run. Defaults to [DefaultTimeout].
	Timeout time.Duration
	// DatabaseURL of the PostgreSQL server. Required. The run creates its
	// own database on that server (idem_soak_<run>, dropped afterwards), so
	// that a disruption can refuse connections to it without touching
	// anyone else's; the role needs CREATEDB and the right to terminate
	// backends (a superuser, or pg_signal_backend).
	DatabaseURL string
	// Brokers of a real Kafka cluster; nil starts an in-process kfake broker.
	Brokers []string
	// KeepDatabase leaves the run's database in place for inspection. Defaults to false.
	KeepDatabase bool
	// Executable is the binary started for each consumer process, with
	// [ConsumerEnv] set; its main (or TestMain) must call
	// [RunConsumerIfChild] first. Defaults to the running binary.
	Executable string
	// Outage is how long a database disruption refuses connections.
	// Defaults to [DefaultOutage].
	Outage time.Duration
	// Log receives progress lines. Defaults to io.Discard.
	Log io.Writer
	// Logger receives the in-process components' (producer, forwarder, DLQ
	// replayer) logs. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// ConsumerLogs forwards the consumer processes' logs (info level) to
	// Log. Defaults to false: they log errors only, kept for the report.
	ConsumerLogs bool
}

// FaultCounts is how many faults of each kind a run injects.
type FaultCounts struct {
	KillMidHandler    int // consumer process SIGKILLed while its handler is inside the transaction
	KillAfterCommit   int // consumer process SIGKILLed after COMMIT, before the ack
	Kill              int // consumer process SIGKILLed by the soak at a random moment
	CrashLoop         int // a new consumer process SIGKILLed while its first JoinGroup is held (opt-in: see docs/soak.md)
	DisruptDB         int // the run's database drops every connection and refuses new ones for Outage
	Join              int // extra instance joins a group (rebalance), leaves later (gracefully)
	TerminateConsumer int // pg_terminate_backend on a consumer instance's connections
	TerminateProducer int // pg_terminate_backend on the producer's/forwarder's connections
	RestartForwarder  int // forwarder (or producer publisher) closed and restarted
	OffsetResetPerGrp int // a group's committed offsets reset to the beginning (full replay)
}

// FullFaults is the default fault mix of `make soak`.
var FullFaults = FaultCounts{KillMidHandler: 4, KillAfterCommit: 4, Kill: 4, DisruptDB: 2, Join: 4, TerminateConsumer: 8, TerminateProducer: 4, RestartForwarder: 4, OffsetResetPerGrp: 1}

// ShortFaults is the mix of the short run in `make test`.
var ShortFaults = FaultCounts{KillMidHandler: 1, KillAfterCommit: 1, Kill: 1, DisruptDB: 1, Join: 1, TerminateConsumer: 2, TerminateProducer: 1, RestartForwarder: 1, OffsetResetPerGrp: 1}

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Events, DefaultEvents)
	def(&c.Aggregates, DefaultAggregates)
	def(&c.Instances, DefaultInstances)
	def(&c.SecondInstances, DefaultSecondInstances)
	def(&c.Producers, DefaultProducers)
	def(&c.DLQPercent, DefaultDLQPercent)
	def(&c.DoublePercent, DefaultDoublePercent)
	c.DLQPercent, c.DoublePercent = max(c.DLQPercent, 0), max(c.DoublePercent, 0) // negative: none
	if c.Partitions == 0 {
		c.Partitions = DefaultPartitions
	}
	if c.Faults == (FaultCounts{}) {
		c.Faults = FullFaults
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Outage == 0 {
		c.Outage = DefaultOutage
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.DatabaseURL == "":
		return errors.New("field DatabaseURL: required")
	case c.Events < 1, c.Aggregates < 1, c.Partitions < 1, c.Instances < 1, c.SecondInstances < 1, c.Producers < 1:
		return errors.New("fields Events, Aggregates, Partitions, Instances, SecondInstances, Producers: must be positive")
	case c.DLQPercent < 0 || c.DLQPercent > 100, c.DoublePercent < 0 || c.DoublePercent > 100:
		return errors.New("fields DLQPercent, DoublePercent: must be in [0, 100]")
	}
	return nil
}

// Report is the outcome of a run.
type Report struct {
	Seed    uint64
	Events  int
	Elapsed time.Duration
	// Producer is "outbox+forwarder" or "kafka" (direct publish).
	Producer string
	// Consumers is "one transaction per message" or "group commit".
	Consumers string
	// Faults counts injected faults by kind; Skipped those that found no target.
	Faults  map[string]int
	Skipped map[string]int
	// Kills counts consumer processes killed with SIGKILL (all kinds);
	// Disruptions the database outages (every connection dropped, new ones
	// refused for Outage).
	Kills, Disruptions int
	Outage             time.Duration
	// TerminatedBackends counts PostgreSQL backends killed by
	// pg_terminate_backend (the pg-terminate faults and the disruptions).
	TerminatedBackends int
	// IOTimeouts counts "i/o timeout" errors in the consumers' logs: a
	// consumer group that cannot re-form logs one per member per
	// Net.ReadTimeout.
	IOTimeouts int
	// ForwarderExits counts forwarders that stopped on an error (and were
	// started again).
	ForwarderExits int
	// Database is the run's database, when kept.
	Database string
	// OutboxRows is the number of outbox rows written (all forwarded when
	// the run passes); 0 with DirectPublish.
	OutboxRows int
	// DLQReplayed and DoublePublished count the duplicate copies sent.
	DLQReplayed     int
	DoublePublished int
	// Per consumer group.
	Groups []GroupReport
	// Violations of the invariants; empty means the run passed.
	Violations []string
}

// GroupReport is one consumer group's view.
type GroupReport struct {
	Name string
	// Deliveries reached the dedup middleware; Applied committed the
	// handler's effect; Duplicates were acknowledged without running the
	// handler; Failed returned an error (injected fault, terminated backend)
	// and were redelivered.
	Deliveries, Applied, Duplicates, Failed int64
	// LedgerRows, DistinctEvents and Sum are read from the ledger at the end.
	LedgerRows, DistinctEvents int
	Sum                        int64
	// Lost counts the events the producer committed that the group never
	// applied; Double those it applied more than once. Both are read from
	// the ledger and must be 0.
	Lost, Double int
}

// OK reports whether the run found no violation.
func (r *Report) OK() bool { return len(r.Violations) == 0 }

// String renders the report for a terminal.
func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "soak seed=%d events=%d producer=%s consumers=%q elapsed=%s\n", r.Seed, r.Events, r.Producer, r.Consumers, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "kills (consumer processes SIGKILLed)=%d disruptions (database refused connections for %s)=%d\n", r.Kills, r.Outage, r.Disruptions)
	b.WriteString("faults injected:\n")
	kinds := maps.Clone(r.Faults)
	maps.Copy(kinds, r.Skipped)
	for _, k := range slices.Sorted(maps.Keys(kinds)) {
		fmt.Fprintf(&b, "  %-22s %d", k, r.Faults[k])
		if s := r.Skipped[k]; s > 0 {
			fmt.Fprintf(&b, " (%d skipped: no target)", s)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "  %-22s %d\n", "backends terminated", r.TerminatedBackends)
	fmt.Fprintf(&b, "  %-22s %d\n", "dlq replayed", r.DLQReplayed)
	fmt.Fprintf(&b, "  %-22s %d\n", "published twice", r.DoublePublished)
	fmt.Fprintf(&b, "consumer log lines with \"i/o timeout\": %d\n", r.IOTimeouts)
	if r.ForwarderExits > 0 {
		fmt.Fprintf(&b, "forwarders stopped on an error and started again: %d\n", r.ForwarderExits)
	}
	if r.OutboxRows > 0 {
		fmt.Fprintf(&b, "outbox rows written and forwarded: %d\n", r.OutboxRows)
	}
	for _, g := range r.Groups {
		fmt.Fprintf(&b, "group %s: lost=%d double=%d | deliveries=%d applied=%d duplicates absorbed=%d failed+redelivered=%d ledger rows=%d distinct=%d sum=%d\n",
			g.Name, g.Lost, g.Double, g.Deliveries, g.Applied, g.Duplicates, g.Failed, g.LedgerRows, g.DistinctEvents, g.Sum)
	}
	if r.Database != "" {
		fmt.Fprintf(&b, "database kept: %s\n", r.Database)
	}
	if r.OK() {
		b.WriteString("PASS: every event applied exactly once per group\n")
	} else {
		fmt.Fprintf(&b, "FAIL (seed %d): %d violation(s)\n", r.Seed, len(r.Violations))
		for _, v := range r.Violations {
			fmt.Fprintf(&b, "  - %s\n", v)
		}
	}
	return b.String()
}

// harness is one run's shared state.
type harness struct {
	cfg     Config
	runID   string
	dbName  string // the run's own database
	exe     string // binary of the consumer processes
	schema  string
	table   deduplicator.TableConfig
	topic   string
	dlq     string
	brokers []string
	admin   *pgxpool.Pool // on the run's database
	maint   *pgxpool.Pool // on DatabaseURL's database: creates, disrupts and drops the run's
	logger  watermill.LoggerAdapter

	plan     []event
	produced atomic.Int64

	groups []*group
	prod   producer
	dlqR   *dlqReplayer

	mu         sync.Mutex
	report     *Report
	violations []string

	dlqSent         atomic.Int64
	dlqReplayedIDs  sync.Map
	doublePublished atomic.Int64
	terminated      atomic.Int64
	kills           atomic.Int64
	forwarderExits  atomic.Int64
	disruptions     atomic.Int64
	ioTimeouts      atomic.Int64

	closing atomic.Bool    // the run is over: no consumer restarts
	bg      sync.WaitGroup // consumer process waiters and restarts
}

func (h *harness) logf(format string, args ...any) {
	fmt.Fprintf(h.cfg.Log, "soak: "+format+"\n", args...)
}

func (h *harness) violation(format string, args ...any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.violations) < 100 {
		h.violations = append(h.violations, fmt.Sprintf(format, args...))
	}
}

func (h *harness) fault(kind string, skipped bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if skipped {
		h.report.Skipped[kind]++
		return
	}
	h.report.Faults[kind]++
}

// Run executes one soak. The returned error is for set-up failures; invariant
// violations are in the report (see [Report.OK]).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	start := time.Now()

	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	runID := hex.EncodeToString(rnd[:])
	exe := cfg.Executable
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("consumer executable: %w", err)
		}
	}
	h := &harness{
		cfg:    cfg,
		runID:  runID,
		dbName: "idem_soak_" + runID,
		exe:    exe,
		schema: "soak_" + runID,
		topic:  "soak-events-" + runID,
		dlq:    "soak-dlq-" + runID,
		logger: cfg.Logger,
		report: &Report{Seed: cfg.Seed, Events: cfg.Events, Outage: cfg.Outage, Faults: map[string]int{}, Skipped: map[string]int{}},
	}
	h.table = tableConfig(h.schema)
	h.plan = makePlan(cfg)

	h.brokers = cfg.Brokers
	if len(h.brokers) == 0 {
		fake, err := kafkatest.NewFake()
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		defer fake.Close()
		h.brokers = fake.ListenAddrs()
	}
	for _, t := range []string{h.topic, h.dlq} {
		if err := kafkatest.CreateTopic(h.brokers, t, cfg.Partitions); err != nil {
			return nil, fmt.Errorf("create topic %s: %w", t, err)
		}
	}

	defer h.dropDB()
	if err := h.setupDB(ctx); err != nil {
		return nil, err
	}

	err := h.run(ctx)
	h.report.Elapsed = time.Since(start)
	if err != nil {
		return h.report, err
	}
	return h.report, nil
}

func (h *harness) pool(ctx context.Context, component string, maxConns int32) (*pgxpool.Pool, error) {
	return pgPool(ctx, h.cfg.DatabaseURL, h.dbName, h.schema, h.appName(component), maxConns)
}

// appName is the application_name of a component's connections, which the
// pg_terminate_backend fault targets.
func (h *harness) appName(component string) string { return "soak-" + h.runID + "-" + component }

func (h *harness) setupDB(ctx context.Context) error {
	pc, err := pgxpool.ParseConfig(h.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("parse %s: %w", h.cfg.DatabaseURL, err)
	}
	pc.ConnConfig.RuntimeParams["application_name"] = h.appName("maint")
	pc.MaxConns = 2
	if h.maint, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return fmt.Errorf("connect %s: %w", h.cfg.DatabaseURL, err)
	}
	if _, err := h.maint.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{h.dbName}.Sanitize()); err != nil {
		h.dbName = "" // nothing to drop
		return fmt.Errorf("create database: %w", err)
	}
	h.admin, err = h.pool(ctx, "admin", 4)
	if err != nil {
		return err
	}
	if _, err := h.admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{h.schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	if err := deduplicator.Migrate(ctx, h.admin, h.table); err != nil {
		return fmt.Errorf("migrate processed_event: %w", err)
	}
	_, err = h.admin.Exec(ctx, `
CREATE TABLE soak_event (
    event_id  uuid   PRIMARY KEY,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL,
    UNIQUE (aggregate, seq)
);
-- No unique key on purpose: a double application must show up as two rows.
CREATE TABLE soak_ledger (
    applied   bigserial PRIMARY KEY,
    grp       text   NOT NULL,
    event_id  uuid   NOT NULL,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL
);`)
	if err != nil {
		return fmt.Errorf("create soak tables: %w", err)
	}
	return nil
}

func (h *harness) dropDB() {
	if h.admin != nil {
		h.admin.Close()
	}
	if h.maint == nil {
		return
	}
	defer h.maint.Close()
	if h.dbName == "" {
		return
	}
	if h.cfg.KeepDatabase {
		h.report.Database = h.dbName
		h.logf("kept database %s (schema %s)", h.dbName, h.schema)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// FORCE: a disruption may have left the database refusing connections,
	// and a consumer killed late may still be disconnecting.
	if _, err := h.maint.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{h.dbName}.Sanitize()+" WITH (FORCE)"); err != nil {
		h.logf("drop database %s: %v", h.dbName, err)
	}
}

func (h *harness) run(ctx context.Context) error {
	for i, n := range []int{h.cfg.Instances, h.cfg.SecondInstances} {
		h.groups = append(h.groups, &group{h: h, idx: i, name: fmt.Sprintf("soak-g%d-%s", i+1, h.runID), base: n})
	}
	prod, err := h.newProducer(ctx)
	if err != nil {
		return err
	}
	h.prod = prod
	h.report.Producer = prod.kind()
	h.report.Consumers = "one transaction per message"
	if h.cfg.GroupCommit {
		h.report.Consumers = "group commit"
	}
	if err := h.startDLQReplayer(ctx); err != nil {
		return err
	}
	defer h.shutdown()
	for _, g := range h.groups {
		for range g.base {
			if _, err := g.start(ctx); err != nil {
				return fmt.Errorf("%s: start: %w", g.name, err)
			}
		}
	}

	schedule := makeSchedule(h.cfg)
	h.logf("seed=%d events=%d aggregates=%d partitions=%d producer=%q faults scheduled=%d database=%s consumers=%s",
		h.cfg.Seed, h.cfg.Events, h.cfg.Aggregates, h.cfg.Partitions, prod.kind(), len(schedule), h.dbName, h.exe)

	faultsDone := make(chan struct{})
	go func() {
		defer close(faultsDone)
		h.runFaults(ctx, schedule)
	}()
	go h.progressLog(ctx, faultsDone)

	if err := h.runProducers(ctx); err != nil {
		h.violation("producer: %v", err)
	}
	h.logf("produced %d events", h.produced.Load())
	select {
	case <-faultsDone:
	case <-ctx.Done():
	}
	h.waitConverged(ctx)
	return h.verify(context.WithoutCancel(ctx))
}

func (h *harness) shutdown() {
	h.closing.Store(true)
	var wg sync.WaitGroup
	for _, g := range h.groups {
		g.mu.Lock()
		live := append([]*instance(nil), g.live...)
		g.mu.Unlock()
		for _, inst := range live {
			wg.Go(inst.stop)
		}
	}
	wg.Wait()
	h.bg.Wait()
	if h.dlqR != nil {
		h.dlqR.close()
	}
	if h.prod != nil {
		h.prod.close()
	}
}

func (h *harness) progressLog(ctx context.Context, faultsDone <-chan struct{}) {
	t := time.NewTicker(3 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pend, _ := h.prod.pending(ctx)
		line := fmt.Sprintf("produced=%d outbox pending=%d", h.produced.Load(), pend)
		for _, g := range h.groups {
			line += fmt.Sprintf(" %s: applied=%d dup=%d failed=%d", g.name, g.applied.Load(), g.duplicates.Load(), g.failed.Load())
		}
		h.mu.Lock()
		line += fmt.Sprintf(" faults=%v", h.report.Faults)
		line += fmt.Sprintf(" i/o timeouts=%d", h.ioTimeouts.Load())
		h.mu.Unlock()
		h.logf("%s", line)
	}
}

// waitConverged waits until every event is applied by both groups, every
// copy (DLQ replay, double publish, offset replay) is consumed, and nothing
// is left to forward; or until ctx ends (then the verification reports what
// is missing).
func (h *harness) waitConverged(ctx context.Context) {
	for {
		ok, why := h.converged(ctx)
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			h.violation("did not converge before the timeout: %s", why)
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (h *harness) converged(ctx context.Context) (bool, string) {
	if n, err := h.prod.pending(ctx); err != nil || n > 0 {
		return false, fmt.Sprintf("outbox rows not forwarded: %d (%v)", n, err)
	}
	for _, g := range h.groups {
		g.mu.Lock()
		live := len(g.live)
		g.mu.Unlock()
		if live == 0 {
			return false, g.name + ": no live instance"
		}
		var n int
		if err := h.admin.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM soak_ledger WHERE grp = $1`, g.name).Scan(&n); err != nil {
			return false, err.Error()
		}
		if n < h.cfg.Events {
			return false, fmt.Sprintf("%s applied %d of %d events", g.name, n, h.cfg.Events)
		}
	}
	replayed := 0
	h.dlqReplayedIDs.Range(func(any, any) bool { replayed++; return true })
	if int64(replayed) < h.dlqSent.Load() {
		return false, fmt.Sprintf("dlq replayed %d of %d", replayed, h.dlqSent.Load())
	}
	if lag, err := h.lag("soak-dlq-replay-"+h.runID, h.dlq); err != nil || lag > 0 {
		return false, fmt.Sprintf("dlq replayer lag %d (%v)", lag, err)
	}
	for _, g := range h.groups {
		if lag, err := h.lag(g.name, h.topic); err != nil || lag > 0 {
			return false, fmt.Sprintf("%s lag %d (%v)", g.name, lag, err)
		}
	}
	return true, ""
}

func (h *harness) newProducer(ctx context.Context) (producer, error) {
	if h.cfg.DirectPublish {
		return newKafkaProducer(ctx, h)
	}
	return newOutboxProducer(ctx, h)
}
