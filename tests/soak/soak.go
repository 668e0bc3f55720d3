package soak

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/kfake"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

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
	// hostile is the failing key's state ([Config.HostileKeys]); nil
	// without hostile keys.
	hostile *hostileState
	// cluster is the run's database server in a run with the failover
	// fault; nil on DatabaseURL's server.
	cluster *dbCluster
	// dbGate is held for writing by the failover, for reading by the
	// producers (each event) and the faults that write to the database or
	// kill its backends: none runs during a failover, and the standby has
	// everything they wrote before it.
	dbGate sync.RWMutex

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

	h, err := newHarness(cfg)
	if err != nil {
		return nil, err
	}
	closeBroker, err := h.startBroker()
	if err != nil {
		return nil, err
	}
	defer closeBroker()
	if err := h.createTopics(); err != nil {
		return nil, err
	}

	stopCluster, err := h.startCluster()
	if err != nil {
		return nil, err
	}
	defer stopCluster() // after dropDB
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

	err = h.run(ctx)
	h.report.Elapsed = time.Since(start)
	if err != nil {
		return h.report, err
	}
	return h.report, nil
}

// newHarness is the harness of a run of cfg: its names (from a random run
// id), the consumer executable and the plan of events.
func newHarness(cfg Config) (*harness, error) {
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
		switch {
		case ev.fail >= poisonFail:
			h.report.PoisonEvents++
		case ev.fail > 0:
			h.report.RetryEvents++
			h.report.RetryFailures += ev.fail
		}
	}
	return h, nil
}

// startBroker starts an in-process kfake broker unless the config names
// brokers, and returns how to stop it.
func (h *harness) startBroker() (stop func(), err error) {
	h.brokers = h.cfg.Brokers
	if len(h.brokers) > 0 {
		return func() {}, nil
	}
	var opts []kfake.Opt
	if h.cfg.Faults.LeaderElection > 0 {
		// Leaders to move between: three brokers.
		opts = append(opts, kfake.NumBrokers(leaderBrokers))
	}
	if h.cfg.Engine == EngineFranz {
		opts = append(opts, kfake.BrokerConfigs(franzBrokerConfigs))
	}
	fake, err := kafkatest.NewFake(opts...)
	if err != nil {
		return nil, fmt.Errorf("start kfake: %w", err)
	}
	h.brokers = fake.ListenAddrs()
	h.trace = newGroupTrace(fake)
	h.fake = fake
	return fake.Close, nil
}

// franzBrokerConfigs are the in-process broker's settings of the KIP-848
// and share groups on the franz-go legs. The broker runs the sessions of
// those groups (a member's heartbeat interval and its session timeout,
// which a classic member asks for in its JoinGroup): as Sarama's 10 s
// session of the other legs, a killed member's partitions, or the
// share-group records it had acquired, go to the others 10 s after its
// death instead of Kafka's default 45 s; heartbeats every 500 ms, so
// that an assignment change reaches the members at once.
var franzBrokerConfigs = map[string]string{
	"group.consumer.heartbeat.interval.ms": "500",
	"group.consumer.session.timeout.ms":    "10000",
	"group.share.heartbeat.interval.ms":    "500",
	"group.share.session.timeout.ms":       "10000",
}

// createTopics creates the run's topics: the events, the DLQ, and each
// group's poison and retry topics.
func (h *harness) createTopics() error {
	topics := []string{h.topic, h.dlq}
	for g := range groups {
		topics = append(append(topics, h.poisonTopic(g)), h.retryTopics(g)...)
	}
	for _, t := range topics {
		if err := kafkatest.CreateTopic(h.brokers, t, h.cfg.Partitions); err != nil {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	h.topics = topics
	return nil
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
	switch {
	case h.cfg.Share:
		h.report.Consumers += ", franz-go share group (KIP-932)"
	case h.cfg.Engine == EngineFranz:
		h.report.Consumers += ", franz-go subscriber (group protocol " + h.cfg.GroupProtocol + ")"
	}
	if h.cfg.HostileKeys {
		h.report.Consumers += fmt.Sprintf(", hostile keys (PartitionWindow %d)", HostilePartitionWindow)
	}
	if err := h.startHostile(ctx); err != nil {
		return err
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

func (h *harness) newProducer(ctx context.Context) (producer, error) {
	if h.cfg.DirectPublish {
		return newKafkaProducer(ctx, h)
	}
	return newOutboxProducer(ctx, h)
}
