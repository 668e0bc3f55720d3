package soak

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/ThreeDotsLabs/watermill"
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
	DefaultTimeout         = 25 * time.Minute
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
	// EngineSarama and EngineFranz are the values of [Config.Engine].
	EngineSarama = "sarama"
	EngineFranz  = "franz"
	// ShareMaxDeliveries is the share-group leg's
	// franz.SubscriberConfig.MaxDeliveries: from this delivery on, a
	// failure is permanent and the poison queue takes the message.
	ShareMaxDeliveries = 4
	// SharePoisonPercent is the percent of the share-group leg's events
	// that fail on every delivery: the poison queue must take each of
	// them at delivery [ShareMaxDeliveries] ([Config.Share]).
	SharePoisonPercent = 1
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
	// (idem.Config.Mode = &idem.GroupCommitConfig{} with its defaults). Defaults to false: one
	// transaction per message.
	GroupCommit bool
	// Parallel makes each consumer process consume with idemkafka's
	// parallel subscriber (key order; [ParallelMaxInFlight] messages in
	// flight on the main topic, [ParallelRetryMaxInFlight] on each retry
	// topic, whose copies wait in their partition's window until their
	// not-before time) instead of watermill-kafka's. Defaults to false.
	Parallel bool
	// HostileKeys adds two hostile partition keys to a [Config.Parallel]
	// run: a hot key (about 1 % of the events; its handler sleeps 200 to
	// 500 ms on each, drawn from the seed) and a failing key (about 2 %;
	// the handler fails on its first event, which is nacked, not moved to
	// a retry topic nor poisoned, until its group has applied 60 % of the
	// other events), with the main topic's PartitionWindow at
	// [HostilePartitionWindow] so that the failing key's waiting events
	// are spilled. The run checks that both keys' events were applied once
	// each and in order, and that the other keys flowed around them.
	// Not in lease mode. Defaults to false.
	HostileKeys bool
	// Engine is the Kafka engine of the consumers' subscribers:
	// [EngineSarama] (watermill-kafka's subscriber, or idemkafka's parallel
	// one with Parallel) or [EngineFranz] (idemkafka/franz's Subscriber on
	// the main topic and each retry topic, [ParallelMaxInFlight] and
	// [ParallelRetryMaxInFlight] messages in flight, in key order, on the
	// consumer group protocol GroupProtocol; in either commit mode, not in
	// lease mode). Defaults to EngineSarama.
	Engine string
	// GroupProtocol is, with Engine [EngineFranz], the consumer groups'
	// protocol: "consumer" (KIP-848) or "classic" (cooperative-sticky).
	// Defaults to "consumer".
	GroupProtocol string
	// Static makes, with Engine [EngineFranz] (not Share), each consumer
	// process a static member (franz.SubscriberConfig.InstanceID) named
	// after its slot, the lowest one no live process of its group holds:
	// a process started after a kill or a stop takes the slot it freed, as
	// a StatefulSet's pod does. After a SIGKILL its KIP-848 rejoin is
	// refused (UNRELEASED_INSTANCE_ID) until the broker's session timeout
	// expires the killed member. Defaults to false.
	Static bool
	// Share makes each consumer process consume the main topic as a member
	// of a KIP-932 share group (idemkafka/franz's share subscriber; Engine
	// [EngineFranz]): no order is kept, so the run does not check the
	// aggregates' order; no retry topic either: a failed event is released
	// and redelivered by the broker, and its delivery count drives the
	// poison queue (franz.RecordErrors, MaxDeliveries
	// [ShareMaxDeliveries]). The planned transient failures are 1 (faults
	// may cost an event two more deliveries), [SharePoisonPercent] of
	// the events fail on every delivery and must be poisoned, at delivery
	// [ShareMaxDeliveries], and every other event applied exactly once.
	// Not with Lease, Parallel or HostileKeys. Defaults to false.
	Share bool
	// Lease runs the consumers' dedup middleware in lease mode
	// (idem.Config.Mode = &idem.LeaseConfig{}, Duration [Config.LeaseDuration]): the handler
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
	// SkipProgress keeps the consumer groups' position in Kafka only: no
	// <table>_progress (idem.Config.SkipProgress), no Progress on the
	// parallel subscribers, no rewind after the failover fault. The run
	// that shows the failover's loss. Defaults to false.
	SkipProgress bool
	// SubscriberProgress makes watermill-kafka's subscribers (not Parallel,
	// not Engine franz, which keep theirs already) keep the groups'
	// positions themselves, by Kafka group (idemkafka.ClientConfig.Progress):
	// every claim starts from PostgreSQL's position, so the failover fault
	// needs no rewind. Defaults to false (the middleware's position and the
	// operator's rewind).
	SubscriberProgress bool
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
	RollingRestart    int // every instance of a group stopped gracefully (SIGTERM) and started again, one after the other
	// Failover runs the run's database on a throwaway primary with an
	// asynchronous standby behind a movable address (internal/testkit/
	// pgcluster) and fails over to the standby once, after cutting
	// replication (see [harness.failover]). Only 1 is meaningful; it needs
	// the PostgreSQL server programs (skipped with one line without them).
	Failover int
}

// FullFaults is the default fault mix of `make soak`. It has no failover:
// `make soak/failover` runs the full mix with the failover and the default
// failing events (-faults failover=1), on watermill-kafka's subscriber and
// on the parallel one.
var FullFaults = FaultCounts{KillMidHandler: 4, KillAfterCommit: 4, Kill: 4, DisruptDB: 2, Join: 4, TerminateConsumer: 8, TerminateProducer: 4, RestartForwarder: 4, OffsetResetPerGrp: 1, LeaderElection: 3, OversizeRow: 2}

// ShortFaults is the mix of the short run in `make test`. It has no
// failover: its parallel legs keep the cooperative-sticky strategy, which
// a failover run replaces (TestSoakFailover runs the failover alone).
var ShortFaults = FaultCounts{KillMidHandler: 1, KillAfterCommit: 1, Kill: 1, DisruptDB: 1, Join: 1, TerminateConsumer: 2, TerminateProducer: 1, RestartForwarder: 1, OffsetResetPerGrp: 1, LeaderElection: 1, OversizeRow: 1}

// ShortLeaseFaults is the short mix of the lease-mode leg: the short mix,
// with two kills after a call (before its completion) and two during one.
var ShortLeaseFaults = withLeaseKills(ShortFaults, 2, 2)

// FullLeaseFaults is the full mix of the lease-mode leg.
var FullLeaseFaults = withLeaseKills(FullFaults, 4, 4)

// FullFranzFaults is the full mix of the franz-go engine's KIP-848 leg
// (Engine [EngineFranz]): the full mix and two rolling restarts.
var FullFranzFaults = withRolling(FullFaults, 2)

// ShortFranzFaults is its short mix: the short mix and a rolling restart.
var ShortFranzFaults = withRolling(ShortFaults, 1)

// FullShareFaults is the full mix of the share-group leg ([Config.Share]):
// the full mix but the offset resets (a share group commits no offsets).
var FullShareFaults = withoutOffsets(FullFaults)

// ShortShareFaults is its short mix.
var ShortShareFaults = withoutOffsets(ShortFaults)

func withRolling(f FaultCounts, n int) FaultCounts {
	f.RollingRestart = n
	return f
}

func withoutOffsets(f FaultCounts) FaultCounts {
	f.OffsetResetPerGrp = 0
	return f
}

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
	if c.Share && c.Engine == "" {
		c.Engine = EngineFranz
	}
	if c.Engine == "" {
		c.Engine = EngineSarama
	}
	if c.Engine == EngineFranz && c.GroupProtocol == "" {
		c.GroupProtocol = "consumer"
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
	case c.HostileKeys && (!c.Parallel || c.Lease):
		return errors.New("field HostileKeys: only with Parallel, not in lease mode")
	case c.Engine != EngineSarama && c.Engine != EngineFranz:
		return fmt.Errorf("field Engine: %q: %s or %s", c.Engine, EngineSarama, EngineFranz)
	case c.Engine == EngineFranz && (c.Parallel || c.Lease || c.HostileKeys):
		return errors.New("field Engine: franz runs its own subscribers, without Parallel, Lease or HostileKeys")
	case c.Engine == EngineFranz && c.GroupProtocol != "consumer" && c.GroupProtocol != "classic":
		return fmt.Errorf("field GroupProtocol: %q: consumer or classic", c.GroupProtocol)
	case c.Engine != EngineFranz && c.GroupProtocol != "":
		return errors.New("field GroupProtocol: only with Engine franz")
	case c.Static && (c.Engine != EngineFranz || c.Share):
		return errors.New("field Static: only with Engine franz on consumer groups, not with Share")
	case c.Share && c.Engine != EngineFranz:
		return errors.New("field Share: only with Engine franz")
	case c.Share && c.Faults.OffsetResetPerGrp > 0:
		return errors.New("field Faults.OffsetResetPerGrp: a share group commits no offsets to reset")
	case c.Faults.KillMidCall > 0 && !c.Lease:
		return errors.New("field Faults.KillMidCall: only in lease mode (Lease), where the handler makes a call")
	case c.SubscriberProgress && (c.Parallel || c.Engine == EngineFranz || c.SkipProgress):
		return errors.New("field SubscriberProgress: watermill-kafka's subscribers only (the parallel and franz ones keep theirs), not with SkipProgress")
	case c.Faults.Failover > 1:
		return errors.New("field Faults.Failover: once per run (the standby is the last one)")
	case c.Faults.Failover > 0 && c.Share:
		return errors.New("field Faults.Failover: a share group has no position to keep in PostgreSQL (the broker acknowledged the records whose claims a failover loses): docs/guarantees.md")
	}
	return nil
}
