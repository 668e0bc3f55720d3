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
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
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
	DefaultRetryPercent    = 5
	DefaultTimeout         = 15 * time.Minute
	DefaultOutage          = 3 * time.Second
	// ParallelMaxInFlight is the main topic's MaxInFlight of a consumer
	// process in [Config.Parallel] mode: more handlers at once than the
	// partitions it holds.
	ParallelMaxInFlight = 6
	// ParallelRetryMaxInFlight is each retry topic's.
	ParallelRetryMaxInFlight = 1
	// DefaultLeaseDuration is the lease of the lease-mode leg
	// ([Config.Lease]): short, so that the leases of killed processes
	// expire and are taken over within the run.
	DefaultLeaseDuration = 3 * time.Second
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
	// RetryPercent of the events fail transiently 1 to 3 times (drawn from
	// the seed) in each group's handler before they succeed: the
	// retry-topic leg. The consumers always run the retry-topic chain of
	// docs/retry.md (retrytopic.RetryTopic with KeyOrder outside
	// watermill's Retry, a retry consumer per retry topic in each process);
	// the failures make events go through it. Defaults to
	// [DefaultRetryPercent]; negative means none.
	RetryPercent int
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
	// Parallel makes each consumer process consume with idemkafka's
	// parallel subscriber (key order; [ParallelMaxInFlight] messages in
	// flight on the main topic, [ParallelRetryMaxInFlight] on each retry
	// topic, whose copies wait in their partition's window until their
	// not-before time) instead of watermill-kafka's. Defaults to false.
	Parallel bool
	// Lease runs the consumers' dedup middleware in lease mode
	// (idem.Config.Lease, Duration [Config.LeaseDuration]): the handler
	// calls a fake payment provider in the soak's process with the event's
	// Idempotency-Key, holding no transaction, and registers its ledger row
	// with idem.Complete. The mid-handler kill then lands between the call
	// and the completion ("sigkill-after-call"), and [FaultCounts.KillMidCall]
	// kills a process while the provider executes its call; the run checks
	// that every event was charged exactly once per group at the provider,
	// and that no lease is left. Not with GroupCommit. Defaults to false.
	Lease bool
	// LeaseDuration is the lease's duration in lease mode. Defaults to
	// [DefaultLeaseDuration].
	LeaseDuration time.Duration
	// UnstableIdempotencyKey makes the lease-mode handler send a new
	// Idempotency-Key with each call instead of the event's: a broken
	// handler, to check that the soak catches a double charge. Defaults to
	// false.
	UnstableIdempotencyKey bool
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
	KillMidCall       int // lease mode: consumer process SIGKILLed while the provider executes its call (lease held)
	Kill              int // consumer process SIGKILLed by the soak at a random moment
	CrashLoop         int // a new consumer process SIGKILLed while its first JoinGroup is held (opt-in: see docs/soak.md)
	DisruptDB         int // the run's database drops every connection and refuses new ones for Outage
	Join              int // extra instance joins a group (rebalance), leaves later (gracefully)
	TerminateConsumer int // pg_terminate_backend on a consumer instance's connections
	TerminateProducer int // pg_terminate_backend on the producer's/forwarder's connections
	RestartForwarder  int // forwarder (or producer publisher) closed and restarted
	OffsetResetPerGrp int // a group's committed offsets reset to the beginning (full replay)
	LeaderElection    int // every partition's leader moves to another broker (in-process broker only: it runs 3 brokers then)
	OversizeRow       int // a row larger than the producer's limit written to the outbox table by another writer (outbox producer only)
}

// FullFaults is the default fault mix of `make soak`.
var FullFaults = FaultCounts{KillMidHandler: 4, KillAfterCommit: 4, Kill: 4, DisruptDB: 2, Join: 4, TerminateConsumer: 8, TerminateProducer: 4, RestartForwarder: 4, OffsetResetPerGrp: 1, LeaderElection: 3, OversizeRow: 2}

// ShortFaults is the mix of the short run in `make test`.
var ShortFaults = FaultCounts{KillMidHandler: 1, KillAfterCommit: 1, Kill: 1, DisruptDB: 1, Join: 1, TerminateConsumer: 2, TerminateProducer: 1, RestartForwarder: 1, OffsetResetPerGrp: 1, LeaderElection: 1, OversizeRow: 1}

// ShortLeaseFaults is the short mix of the lease-mode leg: the short mix,
// with two kills after a call (before its completion) and two during one.
var ShortLeaseFaults = withLeaseKills(ShortFaults, 2, 2)

// FullLeaseFaults is the full mix of the lease-mode leg.
var FullLeaseFaults = withLeaseKills(FullFaults, 4, 4)

func withLeaseKills(f FaultCounts, afterCall, midCall int) FaultCounts {
	f.KillMidHandler, f.KillMidCall = afterCall, midCall
	return f
}

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
	def(&c.RetryPercent, DefaultRetryPercent)
	c.DLQPercent, c.DoublePercent, c.RetryPercent = max(c.DLQPercent, 0), max(c.DoublePercent, 0), max(c.RetryPercent, 0) // negative: none
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
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
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
	case c.DLQPercent < 0 || c.DLQPercent > 100, c.DoublePercent < 0 || c.DoublePercent > 100, c.RetryPercent < 0 || c.RetryPercent > 100:
		return errors.New("fields DLQPercent, DoublePercent, RetryPercent: must be in [0, 100]")
	case c.Lease && c.GroupCommit:
		return errors.New("fields Lease, GroupCommit: lease mode batches its phases itself, not with group commit")
	case c.Faults.KillMidCall > 0 && !c.Lease:
		return errors.New("field Faults.KillMidCall: only in lease mode (Lease), where the handler makes a call")
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
	// Consumers is "one transaction per message" or "group commit", with
	// ", parallel subscriber" in [Config.Parallel] mode.
	Consumers string
	// Faults counts injected faults by kind; Skipped those that found no
	// target, or were armed in a consumer but not executed before the run
	// ended. Every scheduled fault is in one or the other.
	Faults  map[string]int
	Skipped map[string]int
	// Scheduled counts the faults the schedule planned, by kind (a join
	// plans its leave; a pg-terminate-producer is reported under the name
	// of the component it hit, pg-terminate-producer or -forwarder).
	Scheduled map[string]int
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
	// Stops counts consumer processes ended with SIGTERM, MaxStop the
	// longest of them from the signal to the process's exit: bounded by
	// the consumers' timeouts (idemkafka's RevokeTimeout, the router's
	// CloseTimeout), or a violation (see [MaxStopWait]).
	Stops   int
	MaxStop time.Duration
	// ForwarderExits counts forwarders that stopped on an error (and were
	// started again).
	ForwarderExits int
	// Database is the run's database, when kept.
	Database string
	// OutboxRows is the number of outbox rows written (all forwarded when
	// the run passes); 0 with DirectPublish.
	OutboxRows int
	// DLQReplayed counts the events copied to the dead-letter topic (and
	// replayed), DoublePublished the events published twice.
	DLQReplayed     int
	DoublePublished int
	// RetryEvents are the events planned to fail transiently (in each
	// group), RetryFailures the failures planned for them in all
	// ([Config.RetryPercent]).
	RetryEvents, RetryFailures int
	// Per consumer group.
	Groups []GroupReport
	// Lease is the lease-mode leg's view; nil in the other modes.
	Lease *LeaseReport
	// Violations of the invariants; empty means the run passed.
	Violations []string
}

// LeaseReport is what a lease-mode run ([Config.Lease]) saw of the leases
// and of the fake provider.
type LeaseReport struct {
	Duration time.Duration
	// Takeovers counts the leases taken over after they expired (a trigger
	// on the lease table logs each change of token, with the owner it was
	// taken from and the expiry it had). TakeoversOfKilled are those still
	// live when their owner was SIGKILLed: each is a delivery killed
	// between its phases (its lease taken, its completion not committed),
	// and KillsBetweenPhases counts the kills that left at least one such
	// lease behind (the armed after-call and mid-call kills always do; a
	// random or after-commit kill when the process had other deliveries in
	// flight). TakeoversOfStopped are those still live when their owner
	// was stopped with SIGTERM. The rest expired while their owner ran: it
	// could neither complete, release nor renew them (a database outage,
	// terminated connections), and wrote nothing for them.
	Takeovers, TakeoversOfKilled, KillsBetweenPhases, TakeoversOfStopped int
	// LeasesLeft is the lease table's rows at the end: must be 0 (every
	// lease completed, released or taken over and completed).
	LeasesLeft int
	// Provider is what the fake payment provider saw.
	Provider ProviderReport
}

// GroupReport is one consumer group's view.
type GroupReport struct {
	Name string
	// Deliveries reached the consumer's chain (from the main topic or a
	// retry topic); Applied committed the handler's effect; Duplicates were
	// acknowledged without running the handler; Failed returned an error and
	// were redelivered: the failures the retry-topic middleware could not
	// move to a retry topic (the database or the broker unreachable, the
	// process closing).
	Deliveries, Applied, Duplicates, Failed int64
	// LedgerRows, DistinctEvents and Sum are read from the ledger at the end.
	LedgerRows, DistinctEvents int
	Sum                        int64
	// Lost counts the events the producer committed that the group never
	// applied; Double those it applied more than once. Both are read from
	// the ledger and must be 0.
	Lost, Double int

	// The retry-topic leg.
	//
	// InProcessRetries is the MaxRetries of the group's watermill Retry.
	// FailedEvents and Failures are read from the database at the end: the
	// events the handler failed on transiently as planned, and how many
	// times in all (equal to [Report.RetryEvents] and
	// [Report.RetryFailures] when the run passes).
	InProcessRetries       int
	FailedEvents, Failures int
	// Escalated counts the deliveries moved to a retry topic after a
	// failure the in-process Retry could not fix (the escalations),
	// EscalatedEvents the distinct events among them (the events that went
	// through a retry topic because they failed), MaxAttempt the highest
	// retry-topic attempt reached. As the processes report them: an
	// escalation whose process was killed before its report is missing.
	Escalated, EscalatedEvents, MaxAttempt int64
	// RetryDeliveries reached the outer middleware from a retry topic;
	// AppliedFromRetry of them applied the event. Deferred counts the
	// deliveries KeyOrder sent along the retry path without running them:
	// later events of a key with an event on the retry path, which follow
	// it there.
	RetryDeliveries, AppliedFromRetry, Deferred int64
	// Poisoned counts messages published to the poison topic; any is a
	// violation.
	Poisoned int64
	// Lease mode: Takeovers of the group's leases, and Charged, its events
	// charged at the provider (each exactly once when the run passes).
	Takeovers, Charged int
	// MaxHandlers is the most main-topic messages one consumer process of
	// the group had in its handler chain at once: at most the partitions
	// it held with watermill-kafka's subscriber, up to
	// [ParallelMaxInFlight] with the parallel one ([Config.Parallel]).
	MaxHandlers int64
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
			fmt.Fprintf(&b, " (%d skipped)", s)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "  %-22s %d\n", "backends terminated", r.TerminatedBackends)
	fmt.Fprintf(&b, "  %-22s %d\n", "dlq replayed", r.DLQReplayed)
	fmt.Fprintf(&b, "  %-22s %d\n", "published twice", r.DoublePublished)
	fmt.Fprintf(&b, "  %-22s %d events, %d failures in each group\n", "planned to fail", r.RetryEvents, r.RetryFailures)
	fmt.Fprintf(&b, "consumer log lines with \"i/o timeout\": %d\n", r.IOTimeouts)
	fmt.Fprintf(&b, "consumers stopped with SIGTERM: %d, the longest exit %s\n", r.Stops, r.MaxStop.Truncate(time.Millisecond))
	if r.ForwarderExits > 0 {
		fmt.Fprintf(&b, "forwarders stopped on an error and started again: %d\n", r.ForwarderExits)
	}
	if r.OutboxRows > 0 {
		fmt.Fprintf(&b, "outbox rows written and forwarded: %d\n", r.OutboxRows)
	}
	for _, g := range r.Groups {
		fmt.Fprintf(&b, "group %s: lost=%d double=%d | deliveries=%d applied=%d duplicates absorbed=%d failed+redelivered=%d ledger rows=%d distinct=%d sum=%d | main-topic handlers at once in a process: up to %d\n",
			g.Name, g.Lost, g.Double, g.Deliveries, g.Applied, g.Duplicates, g.Failed, g.LedgerRows, g.DistinctEvents, g.Sum, g.MaxHandlers)
		perEvent := 0.0
		if g.AppliedFromRetry > 0 {
			perEvent = float64(g.RetryDeliveries) / float64(g.AppliedFromRetry)
		}
		fmt.Fprintf(&b, "  retry topics (in-process retries %d): failed as planned: %d events, %d times | escalated to a retry topic: %d times, %d events, attempts up to %d | deferred behind their key: %d | retry-topic deliveries=%d applied from a retry topic=%d (%.2f deliveries per event on the retry path) | poisoned=%d\n",
			g.InProcessRetries, g.FailedEvents, g.Failures, g.Escalated, g.EscalatedEvents, g.MaxAttempt, g.Deferred, g.RetryDeliveries, g.AppliedFromRetry, perEvent, g.Poisoned)
	}
	if l := r.Lease; l != nil {
		fmt.Fprintf(&b, "lease mode (lease %s): takeovers=%d: of leases live when their owner was SIGKILLed=%d (left by %d kills between the phases), SIGTERMed=%d, expired under a running owner=%d | leases left=%d\n",
			l.Duration, l.Takeovers, l.TakeoversOfKilled, l.KillsBetweenPhases, l.TakeoversOfStopped, l.Takeovers-l.TakeoversOfKilled-l.TakeoversOfStopped, l.LeasesLeft)
		fmt.Fprintf(&b, "  provider: requests=%d charges executed=%d replayed (same key again)=%d refused in progress (409)=%d", l.Provider.Requests, l.Provider.Charges, l.Provider.Replayed, l.Provider.Conflicts)
		for _, g := range r.Groups {
			fmt.Fprintf(&b, " | %s: charged %d events, takeovers %d", g.Name, g.Charged, g.Takeovers)
		}
		b.WriteString("\n")
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
	parked  retrytopic.ParkedKeysTable
	brokers []string
	trace   *groupTrace    // the in-process broker's group requests; nil on a real cluster
	fake    *kfake.Cluster // the in-process broker; nil on a real cluster
	topics  []string       // every topic of the run
	admin   *pgxpool.Pool  // on the run's database
	maint   *pgxpool.Pool  // on DatabaseURL's database: creates, disrupts and drops the run's
	logger  watermill.LoggerAdapter

	plan     []event
	produced atomic.Int64

	groups []*group
	prod   producer
	dlqR   *dlqReplayer
	// Lease mode: the fake provider the handlers call, and when processes
	// were SIGKILLed and stopped with SIGTERM (by name: the lease table's
	// owner).
	provider        *provider
	killed, stopped sync.Map

	mu         sync.Mutex
	report     *Report
	violations []string

	dlqSentIDs      sync.Map // event ids copied to the dead-letter topic
	dlqReplayedIDs  sync.Map
	doublePublished atomic.Int64
	terminated      atomic.Int64
	kills           atomic.Int64
	forwarderExits  atomic.Int64
	disruptions     atomic.Int64
	ioTimeouts      atomic.Int64
	stops, maxStop  atomic.Int64 // SIGTERMs, and the longest exit (ns)

	closing atomic.Bool    // the run is over: no consumer restarts
	bg      sync.WaitGroup // consumer process waiters and restarts
}

// groups is the number of consumer groups.
const groups = 2

// retryTopics returns the retry topics of consumer group g: attempt 1, then
// attempts 2 and later. They belong to the group: each dedup consumer group
// needs retry topics of its own (docs/retry.md), or one group's retry
// consumers would run the events another group failed on, ahead of their
// turn.
func (h *harness) retryTopics(g int) []string {
	return []string{fmt.Sprintf("soak-g%d-retry1-%s", g+1, h.runID), fmt.Sprintf("soak-g%d-retry2-%s", g+1, h.runID)}
}

// poisonTopic returns the poison topic of consumer group g.
func (h *harness) poisonTopic(g int) string { return fmt.Sprintf("soak-g%d-poison-%s", g+1, h.runID) }

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
		report: &Report{Seed: cfg.Seed, Events: cfg.Events, Outage: cfg.Outage, Faults: map[string]int{}, Skipped: map[string]int{}, Scheduled: map[string]int{}},
	}
	h.table = tableConfig(h.schema)
	h.parked = parkedTable(h.schema)
	h.plan = makePlan(cfg)
	for _, ev := range h.plan {
		if ev.fail > 0 {
			h.report.RetryEvents++
			h.report.RetryFailures += ev.fail
		}
	}

	h.brokers = cfg.Brokers
	if len(h.brokers) == 0 {
		var opts []kfake.Opt
		if cfg.Faults.LeaderElection > 0 {
			// Leaders to move between: three brokers.
			opts = append(opts, kfake.NumBrokers(leaderBrokers))
		}
		fake, err := kafkatest.NewFake(opts...)
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		defer fake.Close()
		h.brokers = fake.ListenAddrs()
		h.trace = newGroupTrace(fake)
		h.fake = fake
	}
	topics := []string{h.topic, h.dlq}
	for g := range groups {
		topics = append(append(topics, h.poisonTopic(g)), h.retryTopics(g)...)
	}
	for _, t := range topics {
		if err := kafkatest.CreateTopic(h.brokers, t, cfg.Partitions); err != nil {
			return nil, fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	h.topics = topics

	defer h.dropDB()
	if err := h.setupDB(ctx); err != nil {
		return nil, err
	}
	if cfg.Lease {
		p, err := newProvider()
		if err != nil {
			return nil, fmt.Errorf("start the fake provider: %w", err)
		}
		defer p.close()
		h.provider = p
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
	if err := migrate.Up(ctx, h.admin, deduplicator.MigrationLine(h.table)); err != nil {
		return fmt.Errorf("migrate processed_event: %w", err)
	}
	if err := migrate.Up(ctx, h.admin, retrytopic.MigrationLine(h.parked)); err != nil {
		return fmt.Errorf("migrate retry_parked_key: %w", err)
	}
	// KeyOrder hands a key on through the outbox, to each group's first
	// retry topic.
	for g := range groups {
		ob, err := handoffOutbox(h.schema, h.retryTopics(g), h.logger)
		if err != nil {
			return err
		}
		if err := migrate.Up(ctx, h.admin, outbox.MigrationLine(ob.Config(), h.retryTopics(g)[0])); err != nil {
			return fmt.Errorf("migrate the hand-off outbox: %w", err)
		}
	}
	// Every change of the parked-keys table, for the diagnosis of a failed
	// run (-keep): which process parked or released which event, in which
	// transaction, when.
	if _, err := h.admin.Exec(ctx, `
CREATE TABLE soak_park_log (
    op       text        NOT NULL,
    grp      text        NOT NULL,
    k        text        NOT NULL,
    event_id uuid        NOT NULL,
    seq      bigint      NOT NULL,
    topic    text        NOT NULL,
    xid      xid8        NOT NULL DEFAULT pg_current_xact_id(),
    app      text        NOT NULL DEFAULT current_setting('application_name'),
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION soak_park_log() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    INSERT INTO soak_park_log (op, grp, k, event_id, seq, topic) VALUES (TG_OP, r.consumer_group, r.partition_key, r.event_id, r.seq, COALESCE(r.topic, ''));
    RETURN r;
END $$;
CREATE TRIGGER soak_park_log AFTER INSERT OR UPDATE OR DELETE ON `+pgx.Identifier{h.parked.Schema, "retry_parked_key"}.Sanitize()+`
    FOR EACH ROW EXECUTE FUNCTION soak_park_log();`); err != nil {
		return fmt.Errorf("create soak_park_log: %w", err)
	}
	_, err = h.admin.Exec(ctx, `
CREATE TABLE soak_event (
    event_id  uuid   PRIMARY KEY,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL,
    fail      int    NOT NULL, -- planned transient failures (per group)
    UNIQUE (aggregate, seq)
);
-- No unique key on purpose: a double application must show up as two rows.
CREATE TABLE soak_ledger (
    applied   bigserial PRIMARY KEY,
    grp       text   NOT NULL,
    event_id  uuid   NOT NULL,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL,
    -- Where it was applied from, for the diagnosis of a failed run (-keep):
    -- the topic, the retry attempt of a copy, the consumer process.
    topic     text   NOT NULL,
    attempt   text   NOT NULL,
    instance  text   NOT NULL,
    xid       xid8   NOT NULL DEFAULT pg_current_xact_id(),
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The handler's "downstream" for the events planned to fail: how many times
-- it failed so far, per group. Written outside the handler's transaction
-- (which rolls back), so that kills and rollbacks keep the count.
CREATE TABLE soak_failure (
    grp      text NOT NULL,
    event_id uuid NOT NULL,
    failures int  NOT NULL,
    PRIMARY KEY (grp, event_id)
);`)
	if err != nil {
		return fmt.Errorf("create soak tables: %w", err)
	}
	// Lease mode: every takeover of a lease (a new token on an existing
	// row; renewals keep the token), with the owner it was taken from.
	_, err = h.admin.Exec(ctx, `
CREATE TABLE soak_lease_takeover (
    grp         text        NOT NULL,
    event_id    uuid        NOT NULL,
    old_owner   text        NOT NULL,
    new_owner   text        NOT NULL,
    attempts    int         NOT NULL,
    old_expires timestamptz NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION soak_lease_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_lease_takeover (grp, event_id, old_owner, new_owner, attempts, old_expires)
    VALUES (NEW.consumer_group, NEW.event_id, OLD.owner, NEW.owner, NEW.attempts, OLD.expires_at);
    RETURN NEW;
END $$;
CREATE TRIGGER soak_lease_takeover AFTER UPDATE ON `+h.leaseTable()+`
    FOR EACH ROW WHEN (OLD.token IS DISTINCT FROM NEW.token) EXECUTE FUNCTION soak_lease_takeover();`)
	if err != nil {
		return fmt.Errorf("create soak_lease_takeover: %w", err)
	}
	return nil
}

// leaseTable is the quoted name of the run's lease table (lease mode).
func (h *harness) leaseTable() string {
	return pgx.Identifier{h.table.Schema, "processed_event_lease"}.Sanitize()
}

// providerURL is the fake provider's endpoint ("" outside lease mode).
func (h *harness) providerURL() string {
	if h.provider == nil {
		return ""
	}
	return h.provider.url
}

// markKilled records when inst was SIGKILLed: the lease table names the
// owner of each lease it held until another delivery takes it over.
func (h *harness) markKilled(inst *instance) { h.killed.Store(inst.name, time.Now()) }

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
	for i, n := range []int{h.cfg.Instances, h.cfg.SecondInstances}[:groups] {
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
	if h.cfg.Parallel {
		h.report.Consumers += ", parallel subscriber"
	}
	if h.cfg.Lease {
		h.report.Consumers = "lease mode"
		if h.cfg.Parallel {
			h.report.Consumers += ", parallel subscriber"
		}
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
	for _, f := range schedule {
		h.report.Scheduled[f.kind]++
		if f.kind == faultJoin {
			h.report.Scheduled[faultLeave]++
		}
	}
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
	for _, g := range h.groups {
		g.skipOrphans()
	}
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
		pend, err := h.prod.pending(ctx)
		line := fmt.Sprintf("produced=%d outbox pending=%d", h.produced.Load(), pend)
		if err != nil {
			line += fmt.Sprintf(" (%v)", err)
		}
		for _, g := range h.groups {
			line += fmt.Sprintf(" %s: applied=%d dup=%d failed=%d escalated=%d", g.name, g.applied.Load(), g.duplicates.Load(), g.failed.Load(), g.escalated.Load())
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
	lastLog := time.Now()
	var lastWhy string
	since, dumped := time.Now(), time.Time{}
	for {
		ok, why := h.converged(ctx)
		if ok {
			return
		}
		if why != lastWhy {
			lastWhy, since = why, time.Now()
		}
		if time.Since(lastLog) > 10*time.Second {
			h.logf("not converged yet: %s", why)
			lastLog = time.Now()
		}
		// The same reason for a minute: no progress. Show what the
		// consumer groups and the processes wait for (once, then every
		// five minutes).
		if time.Since(since) > time.Minute && time.Since(dumped) > 5*time.Minute {
			h.logf("no progress for %s: %s", time.Since(since).Truncate(time.Second), why)
			h.dumpStall()
			dumped = time.Now()
		}
		select {
		case <-ctx.Done():
			h.violation("did not converge before the timeout: %s", why)
			h.logStuck(context.WithoutCancel(ctx))
			h.dumpStall()
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
		if g.liveCount() == 0 {
			return false, g.name + ": no live instance"
		}
		n, err := h.appliedEvents(ctx, g)
		if err != nil {
			return false, err.Error()
		}
		if n < h.cfg.Events {
			return false, fmt.Sprintf("%s applied %d of %d events", g.name, n, h.cfg.Events)
		}
	}
	if missing, sent := h.dlqMissing(); len(missing) > 0 {
		return false, fmt.Sprintf("dlq replayed %d of %d events", sent-len(missing), sent)
	}
	if lag, err := h.lag("soak-dlq-replay-"+h.runID, h.dlq); err != nil || lag > 0 {
		return false, fmt.Sprintf("dlq replayer lag %d (%v)", lag, err)
	}
	for _, g := range h.groups {
		if lag, err := h.lag(g.name, h.topic); err != nil || lag > 0 {
			return false, fmt.Sprintf("%s lag %d (%v)", g.name, lag, err)
		}
		for i, t := range h.retryTopics(g.idx) {
			if lag, err := h.lag(retryGroup(g.name, i), t); err != nil || lag > 0 {
				return false, fmt.Sprintf("%s lag %d on %s (%v)", retryGroup(g.name, i), lag, t, err)
			}
		}
		if n, err := h.parkedEvents(ctx, g.name); err != nil || n > 0 {
			return false, fmt.Sprintf("%s: %d events parked on the retry path (%v)", g.name, n, err)
		}
	}
	return true, ""
}

// appliedEvents counts the distinct events group g has applied (its
// ledger).
func (h *harness) appliedEvents(ctx context.Context, g *group) (n int, err error) {
	err = h.admin.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM soak_ledger WHERE grp = $1`, g.name).Scan(&n)
	return n, err
}

// liveCount is the number of g's running consumer processes.
func (g *group) liveCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.live)
}

// dumpStall logs every consumer group's state and members as the
// coordinator reports them, the group requests the in-process broker saw,
// and asks every live consumer process for a goroutine dump (SIGUSR1: see
// dumpGoroutinesOnSIGUSR1), which it writes to a file and names in its log.
func (h *harness) dumpStall() {
	var names []string
	for _, g := range h.groups {
		names = append(names, g.name)
		for i := range h.retryTopics(g.idx) {
			names = append(names, retryGroup(g.name, i))
		}
	}
	h.logf("stall: consumer groups:%s", describeGroups(h.brokers, names))
	if h.trace != nil {
		for _, n := range names {
			h.logf("stall: %s: group requests the broker received (last %d):%s", n, maxTraceEvents, h.trace.dump(n))
		}
	}
	for _, g := range h.groups {
		g.mu.Lock()
		live := slices.Clone(g.live)
		g.mu.Unlock()
		for _, inst := range live {
			h.logf("stall: %s (pid %d): goroutine dump requested, to %s; its last log lines: %s", inst.name, inst.cmd.Process.Pid,
				filepath.Join(os.TempDir(), fmt.Sprintf("soak-goroutines-%s-%d.txt", inst.name, inst.cmd.Process.Pid)), inst.stderr)
			_ = inst.cmd.Process.Signal(syscall.SIGUSR1)
		}
	}
}

// logStuck logs, after a run that did not converge, each condition of
// converged: the outbox backlog, every consumer group's live processes,
// applied events and lags, and the events left parked on the retry path.
func (h *harness) logStuck(ctx context.Context) {
	pend, err := h.prod.pending(ctx)
	h.logf("stuck: outbox rows not forwarded: %d (%v)", pend, err)
	for _, g := range h.groups {
		n, err := h.appliedEvents(ctx, g)
		h.logf("stuck: %s: %d live instances, applied %d of %d events (%v)", g.name, g.liveCount(), n, h.cfg.Events, err)
	}
	missing, sent := h.dlqMissing()
	lag, err := h.lag("soak-dlq-replay-"+h.runID, h.dlq)
	h.logf("stuck: dlq: %d of %d events not replayed %v, replayer lag %d (%v)", len(missing), sent, missing[:min(len(missing), 10)], lag, err)
	for _, g := range h.groups {
		lag, err := h.lag(g.name, h.topic)
		h.logf("stuck: %s lag %d on %s (%v)", g.name, lag, h.topic, err)
		for i, t := range h.retryTopics(g.idx) {
			lag, err := h.lag(retryGroup(g.name, i), t)
			n, _ := h.records(t)
			h.logf("stuck: %s lag %d on %s of %d records (%v)", retryGroup(g.name, i), lag, t, n, err)
		}
		n, err := h.parkedEvents(ctx, g.name)
		h.logf("stuck: %s: %d parked events (%v)", g.name, n, err)
		rows, err := h.admin.Query(ctx, `SELECT p.partition_key, p.event_id, COALESCE(p.topic, ''), p.not_before, p.parked_at, e.seq, e.fail
FROM `+pgx.Identifier{h.parked.Schema, "retry_parked_key"}.Sanitize()+` p LEFT JOIN soak_event e USING (event_id)
WHERE p.consumer_group = $1 ORDER BY p.partition_key, p.seq LIMIT 20`, g.name)
		if err == nil {
			var (
				key, topic          string
				id                  uuid.UUID
				notBefore, parkedAt *time.Time
				seq, fail           *int
			)
			_, err = pgx.ForEachRow(rows, []any{&key, &id, &topic, &notBefore, &parkedAt, &seq, &fail}, func() error {
				h.logf("stuck:   %s key=%s seq=%v fail=%v event=%s topic=%s not_before=%v parked_at=%v", g.name, key, deref(seq), deref(fail), id, topic, deref(notBefore), deref(parkedAt))
				return nil
			})
		}
		if err != nil {
			h.logf("stuck: %s: parked events: %v", g.name, err)
		}
	}
}

// dlqMissing returns the events copied to the dead-letter topic that the
// replayer has not replayed yet, and how many were copied.
func (h *harness) dlqMissing() (missing []string, sent int) {
	h.dlqSentIDs.Range(func(id, _ any) bool {
		sent++
		if _, ok := h.dlqReplayedIDs.Load(id); !ok {
			missing = append(missing, id.(string))
		}
		return true
	})
	return missing, sent
}

// parkedEvents counts group's rows in the parked-keys table: events on the
// retry path, and the later events of their keys that follow them.
func (h *harness) parkedEvents(ctx context.Context, group string) (n int, err error) {
	err = h.admin.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{h.parked.Schema, "retry_parked_key"}.Sanitize()+` WHERE consumer_group = $1`, group).Scan(&n)
	return n, err
}

// deref shows a nullable column: its value, or NULL.
func deref[T any](p *T) any {
	if p == nil {
		return "NULL"
	}
	return *p
}

func (h *harness) newProducer(ctx context.Context) (producer, error) {
	if h.cfg.DirectPublish {
		return newKafkaProducer(ctx, h)
	}
	return newOutboxProducer(ctx, h)
}
