package soak

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
)

// dbCluster is the run's PostgreSQL server in a run with the failover
// fault: a throwaway primary, its asynchronous standby, and the movable
// address every component connects through.
type dbCluster struct {
	env              *pgcluster.Env
	primary, standby *pgcluster.Cluster
	addr             *pgcluster.Proxy
}

// FailoverReport is what the failover fault did ([FaultCounts.Failover]).
type FailoverReport struct {
	// Servers names the ports: primary, standby, the movable address.
	Servers string
	// AppliedInWindow counts the events the groups applied between the
	// cut and the primary's stop: their transactions never reached the
	// standby.
	AppliedInWindow int64
	// LedgerLost is how many ledger rows the promoted standby lacked: the
	// applications the failover undid, to be applied again.
	LedgerLost int
	// Rewound is how many offsets the rewind moved Kafka's committed
	// offsets back (watermill-kafka's subscriber; the parallel subscriber
	// seeks itself).
	Rewound int64
	// Position says where the groups' position was kept.
	Position string
	// Unpositioned lists the partitions (Kafka group topic/partition) with
	// an offset committed in Kafka but no position in PostgreSQL on the
	// promoted standby: a partition whose first position was written
	// after the cut starts from Kafka's committed offset
	// (docs/guarantees.md's limit) and loses the events it processed
	// after the cut. A retry topic's partition that got its first copy
	// then is one.
	Unpositioned []string
	// Took is the fault's duration, consumers stopped included.
	Took time.Duration
}

func (f *FailoverReport) String() string {
	return fmt.Sprintf("%s; %d events applied after the cut, %d ledger rows lost by the promotion (applied again), %d Kafka offsets rewound; position: %s; partitions with a Kafka offset but no position on the promoted standby: %v; took %s",
		f.Servers, f.AppliedInWindow, f.LedgerLost, f.Rewound, f.Position, f.Unpositioned, f.Took.Round(time.Millisecond))
}

// clusterConf is the run's primary's settings beyond pgcluster's: a run
// holds up to ~100 connections (five to seven consumer processes, the
// producer and forwarder, the harness), on a server of its own.
var clusterConf = []string{"max_connections = 200", "shared_buffers = 64MB"}

// startCluster starts the primary, its standby and the address, when the
// fault mix has a failover, and points the run's DatabaseURL at the
// address. Without the server programs the fault is skipped with one line
// and the run uses DatabaseURL's server. It returns how to remove them.
func (h *harness) startCluster() (stop func(), err error) {
	if h.cfg.Faults.Failover == 0 {
		return func() {}, nil
	}
	env, err := pgcluster.Open()
	if errors.Is(err, pgcluster.ErrNoServer) {
		h.logf("failover fault skipped: %v", err)
		h.report.Scheduled[faultFailover] += h.cfg.Faults.Failover
		h.report.Skipped[faultFailover] += h.cfg.Faults.Failover
		h.cfg.Faults.Failover = 0
		return func() {}, nil
	}
	if err != nil {
		return nil, err
	}
	c := &dbCluster{env: env}
	if c.primary, err = env.StartPrimary("primary", "", clusterConf...); err == nil {
		if c.standby, err = c.primary.StartStandby("standby"); err == nil {
			c.addr, err = env.OpenProxy(c.primary)
		}
	}
	if err != nil {
		env.Close()
		return nil, fmt.Errorf("failover: start the database cluster: %w", err)
	}
	h.cluster = c
	h.cfg.DatabaseURL = c.addr.URL()
	h.report.Failover = &FailoverReport{
		Servers:  fmt.Sprintf("primary :%d, asynchronous standby :%d, address :%d", c.primary.Port, c.standby.Port, c.addr.Port),
		Position: h.positionKept(),
	}
	h.logf("failover: the run's database is on a throwaway cluster: %s", h.report.Failover.Servers)
	return env.Close, nil
}

// subscriberKeepsPosition reports whether the run's subscribers keep the
// groups' positions themselves, by Kafka group, and start from them (the
// parallel and franz ones), rather than the middleware by dedup group with
// the operator's rewind (watermill-kafka's).
func (h *harness) subscriberKeepsPosition() bool {
	return h.cfg.Parallel || h.cfg.Engine == EngineFranz || h.cfg.SubscriberProgress
}

// positionKept says where the groups' position is kept, and who moves
// the consumers to it after the failover.
func (h *harness) positionKept() string {
	switch {
	case h.cfg.SkipProgress:
		return "Kafka only (SkipProgress): no rewind"
	case h.cfg.Parallel:
		return "PostgreSQL; the parallel subscriber starts from it (Progress, sticky strategy)"
	case h.cfg.Engine == EngineFranz:
		return "PostgreSQL; the franz subscriber starts from it on every assignment (Progress, group protocol " + h.cfg.GroupProtocol + ")"
	case h.cfg.SubscriberProgress:
		return "PostgreSQL; watermill-kafka's subscriber starts every claim from it and commits to Kafka only what it holds (idemkafka.ClientConfig.Progress)"
	}
	return "PostgreSQL; Kafka's offsets rewound to it (internal/progresskafka, idemctl groups progress --rewind)"
}

// failover fails the run's database over to its asynchronous standby, as
// an operator's failover would after the primary died:
//
//  1. the consumer processes freeze (SIGSTOP) for [backlogFor], as a
//     slow node would, so that a backlog builds up for step 2; then the
//     producers pause (their transactions would be lost with the
//     primary: docs/outbox.md's loss, not the consumers'), and so do the
//     faults that write or kill backends ([harness.dbGate]); the standby
//     catches up;
//  2. replication is cut; the consumers go on on the primary alone, their
//     transactions and Kafka offsets committed, until their lag is 0;
//  3. with every consumer process stopped (the operator's fence), the
//     primary stops immediately, the standby is promoted, the address is
//     pointed at it; on watermill-kafka's subscriber the harness rewinds
//     each Kafka group to PostgreSQL's position (what `idemctl groups
//     progress --rewind` runs); the consumers start again: the parallel
//     and franz subscribers start from PostgreSQL's position themselves
//     (Progress).
func (h *harness) failover(ctx context.Context) error {
	c, fr := h.cluster, h.report.Failover
	start := time.Now()
	h.waitPositions(ctx, 20*time.Second)
	thaw := h.freeze()
	select {
	case <-time.After(backlogFor):
	case <-ctx.Done():
	}
	h.dbGate.Lock()
	defer h.dbGate.Unlock()
	err := c.standby.WaitCaughtUp(c.primary)
	if err == nil {
		err = c.standby.Cut()
	}
	thaw()
	if err != nil {
		return err
	}
	before := h.progress(scheduled{by: byApplied})
	h.logf("failover: replication cut at %d applications; the consumers go on on the primary alone", before)
	h.waitNoLag(ctx, 30*time.Second)
	fr.AppliedInWindow = h.progress(scheduled{by: byApplied}) - before
	err = h.withConsumersStopped(ctx, func() error {
		onPrimary, err := h.ledgerRows(ctx)
		if err != nil {
			return err
		}
		if err := c.primary.Crash(); err != nil {
			return err
		}
		if err := c.standby.PromoteNow(); err != nil {
			return err
		}
		c.addr.PointTo(c.standby)
		onStandby, err := h.ledgerRows(ctx)
		if err != nil {
			return err
		}
		fr.LedgerLost = onPrimary - onStandby
		fr.Unpositioned = h.unpositioned(ctx)
		h.logf("failover: standby promoted, address moved: %d ledger rows lost (%d applications after the cut); partitions with a Kafka offset but no position on the promoted standby: %v",
			fr.LedgerLost, fr.AppliedInWindow, fr.Unpositioned)
		if h.subscriberKeepsPosition() || h.cfg.SkipProgress {
			return nil
		}
		fr.Rewound, err = h.rewind(ctx)
		return err
	})
	fr.Took = time.Since(start)
	return err
}

// waitPositions waits, for up to d, until each Kafka group of the run has
// a position in PostgreSQL for every partition of its topic (the main
// topic's, the retry topics') that holds a record: a partition without one
// starts from Kafka's committed offset after a failover
// (docs/guarantees.md's limit). The fault is about the positions the
// library keeps, not about that limit. A partition that gets its first
// record after the cut has none on the promoted standby either: the wait
// cannot prevent that, [FailoverReport.Unpositioned] lists it. The wait is
// bounded: a long one would let the consumers drain everything before
// the cut.
func (h *harness) waitPositions(ctx context.Context, d time.Duration) {
	if h.cfg.SkipProgress {
		return
	}
	client, err := sarama.NewClient(h.brokers, sarama.NewConfig())
	if err != nil {
		h.logf("failover: positions not checked: %v", err)
		return
	}
	defer client.Close()
	deadline := time.Now().Add(d)
	var missing []string
	for time.Now().Before(deadline) && ctx.Err() == nil {
		missing = missing[:0]
		for _, g := range h.groups {
			for kg, topic := range h.kafkaGroups(g) {
				if m := h.missingPositions(ctx, client, g, kg, topic); m != "" {
					missing = append(missing, m)
				}
			}
		}
		if len(missing) == 0 {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	h.logf("failover: partitions with records still without a position in PostgreSQL after %s: %v; failing over anyway", d, missing)
}

// missingPositions names the partitions of topic that hold a record but
// have no position of kafkaGroup (of g) in PostgreSQL, "" when none.
func (h *harness) missingPositions(ctx context.Context, client sarama.Client, g *group, kafkaGroup, topic string) string {
	pgGroup := g.name // watermill-kafka: the middleware's, by dedup group
	if h.subscriberKeepsPosition() {
		pgGroup = kafkaGroup // the parallel or franz subscriber's, by its Kafka group
	}
	rows, _, err := progresssql.Load(ctx, h.admin, progresssql.Table(h.table.Schema, "processed_event"), pgGroup, topic)
	if err != nil {
		return fmt.Sprintf("%s %s: %v", kafkaGroup, topic, err)
	}
	has := map[int32]bool{}
	for _, r := range rows {
		has[r.Partition] = true
	}
	var parts []int32
	for p := range h.cfg.Partitions {
		hw, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil || (hw > 0 && !has[p]) {
			parts = append(parts, p)
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("%s %s %v", kafkaGroup, topic, parts)
}

// unpositioned returns the partitions of the run's Kafka groups with an
// offset committed in Kafka but no position in PostgreSQL ("?" when they
// cannot be read).
func (h *harness) unpositioned(ctx context.Context) []string {
	client, err := sarama.NewClient(h.brokers, sarama.NewConfig())
	if err != nil {
		return []string{"? " + err.Error()}
	}
	defer client.Close()
	table := progresssql.Table(h.table.Schema, "processed_event")
	var out []string
	for _, g := range h.groups {
		for kg, topic := range h.kafkaGroups(g) {
			pgGroup := g.name // watermill-kafka: the middleware's, by dedup group
			if h.subscriberKeepsPosition() {
				pgGroup = kg // the parallel or franz subscriber's, by its Kafka group
			}
			rows, err := progresskafka.Compare(ctx, h.admin, table, pgGroup, client, kg, topic)
			if err != nil {
				return []string{"? " + err.Error()}
			}
			has := map[int32]bool{}
			for _, r := range rows {
				has[r.Partition] = true
			}
			committed, err := h.committed(client, kg, topic)
			if err != nil {
				return []string{"? " + err.Error()}
			}
			for p, off := range committed {
				if off > 0 && !has[p] {
					out = append(out, fmt.Sprintf("%s %s/%d", kg, topic, p))
				}
			}
		}
	}
	return out
}

// kafkaGroups returns g's Kafka consumer groups and the topic of each:
// the main topic's and the retry topics'.
func (h *harness) kafkaGroups(g *group) map[string]string {
	kgs := map[string]string{g.name: h.topic}
	for i, t := range h.retryTopics(g.idx) {
		kgs[retryGroup(g.name, i)] = t
	}
	return kgs
}

// committed returns kafkaGroup's committed offset of each partition of
// topic (-1: none).
func (h *harness) committed(client sarama.Client, kafkaGroup, topic string) (map[int32]int64, error) {
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return nil, err
	}
	parts := make([]int32, h.cfg.Partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := admin.ListConsumerGroupOffsets(kafkaGroup, map[string][]int32{topic: parts})
	if err != nil {
		return nil, err
	}
	out := map[int32]int64{}
	for _, p := range parts {
		out[p] = -1
		if b := resp.GetBlock(topic, p); b != nil {
			out[p] = b.Offset
		}
	}
	return out, nil
}

// backlogFor is how long the consumer processes freeze before the cut:
// the events produced meanwhile are applied after it, on the primary alone.
// Well within the consumers' session timeout (10 s): no rebalance.
const backlogFor = 2 * time.Second

// freeze stops every live consumer process (SIGSTOP) and returns how to
// continue them (SIGCONT). A process started meanwhile (a crash's
// replacement) is not frozen.
func (h *harness) freeze() (thaw func()) {
	var procs []*os.Process
	for _, g := range h.groups {
		g.mu.Lock()
		for _, inst := range g.live {
			procs = append(procs, inst.cmd.Process)
		}
		g.mu.Unlock()
	}
	for _, p := range procs {
		_ = p.Signal(syscall.SIGSTOP)
	}
	return func() {
		for _, p := range procs {
			_ = p.Signal(syscall.SIGCONT)
		}
	}
}

// waitNoLag waits until no group lags on the main topic (every record
// forwarded so far applied and its offset committed), for up to d.
func (h *harness) waitNoLag(ctx context.Context, d time.Duration) {
	deadline := time.Now().Add(d)
	var lags []int64
	for time.Now().Before(deadline) && ctx.Err() == nil {
		lags = lags[:0]
		lagging := false
		for _, g := range h.groups {
			n, err := h.lag(g.name, h.topic)
			if err != nil {
				n = -1 // unknown: counts as lag
			}
			lags = append(lags, n)
			lagging = lagging || n != 0
		}
		if !lagging {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	h.logf("failover: the groups still lag %v after %s; failing over anyway", lags, d)
}

// ledgerRows counts the ledger's rows through the address (retried: the
// admin pool's connections die with the primary).
func (h *harness) ledgerRows(ctx context.Context) (n int, err error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = retry(ctx, "count ledger rows", func() error {
		return h.admin.QueryRow(ctx, `SELECT count(*) FROM soak_ledger`).Scan(&n)
	})
	return n, err
}

// withConsumersStopped stops every consumer process of every group (under
// each group's fault lock, as an offset reset does), runs fn, and starts
// as many again.
func (h *harness) withConsumersStopped(ctx context.Context, fn func() error) error {
	ns := make([]int, len(h.groups))
	var wg sync.WaitGroup
	for i, g := range h.groups {
		g.faultMu.Lock()
		defer g.faultMu.Unlock()
		wg.Go(func() { ns[i] = h.halt(g) })
	}
	wg.Wait()
	err := fn()
	for i, g := range h.groups {
		if rerr := g.resume(ctx, ns[i]); rerr != nil && err == nil {
			err = rerr
		}
	}
	return err
}

// rewind moves each Kafka consumer group of the run's dedup groups (the
// main topic's and the retry topics') back to PostgreSQL's position where
// its committed offset is ahead, as `idemctl groups progress GROUP
// --rewind --yes` does. The groups have no members (their consumers are
// stopped); a member's session may take a while to end: it retries.
func (h *harness) rewind(ctx context.Context) (int64, error) {
	client, err := sarama.NewClient(h.brokers, sarama.NewConfig())
	if err != nil {
		return 0, err
	}
	defer client.Close()
	table := progresssql.Table(h.table.Schema, "processed_event")
	var moved int64
	for _, g := range h.groups {
		for kg, topic := range h.kafkaGroups(g) {
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			err := retry(cctx, "rewind "+kg, func() error {
				rows, err := progresskafka.Compare(cctx, h.admin, table, g.name, client, kg, topic)
				if err != nil {
					return err
				}
				done, err := progresskafka.Rewind(client, kg, rows)
				for _, r := range done {
					moved += r.Ahead()
				}
				return err
			})
			cancel()
			if err != nil {
				return moved, err
			}
		}
	}
	h.logf("failover: Kafka's committed offsets rewound by %d to PostgreSQL's position", moved)
	return moved, nil
}
