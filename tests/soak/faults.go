package soak

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
)

// crashDelay is how long a crashed consumer process stays down before its
// replacement starts.
func (h *harness) crashDelay() time.Duration { return 300 * time.Millisecond }

// progress returns the count a fault's mark refers to.
func (h *harness) progress(f scheduled) int64 {
	switch f.by {
	case byProduced:
		return h.produced.Load()
	case byGroup:
		return h.groups[f.group].applied.Load()
	}
	var p int64
	for _, g := range h.groups {
		p += g.applied.Load()
	}
	return p
}

// runFaults fires each scheduled fault, in its own goroutine, once the
// progress it counts reaches its mark, and waits for all of them.
func (h *harness) runFaults(ctx context.Context, schedule []scheduled) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, f := range schedule {
		wg.Go(func() {
			for h.progress(f) < f.at {
				select {
				case <-ctx.Done():
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
			h.inject(ctx, f)
		})
	}
}

func (h *harness) inject(ctx context.Context, f scheduled) {
	g := h.groups[f.group]
	switch f.kind {
	case faultKillMid, faultKillAfterCall, faultKillCommit, faultKillMidCall:
		h.armKill(ctx, g, f)
	case faultSigkill:
		h.sigkill(ctx, g, f)
	case faultCrashLoop:
		done, err := g.crashLoop(ctx)
		if err != nil {
			h.violation("%s: crash loop: %v", g.name, err)
			return
		}
		if !done {
			h.fault(f.kind, true)
			return
		}
		h.kills.Add(1)
		h.fault(f.kind, false)
	case faultDisrupt:
		h.dbGate.RLock()
		h.counted(f.kind, "database disruption", h.disrupt(ctx))
		h.dbGate.RUnlock()
	case faultJoin:
		h.joinUntil(ctx, g, f)
	case faultRolling:
		h.counted(f.kind, g.name+": rolling restart", h.rollingRestart(ctx, g))
	case faultTermConsumer:
		h.terminate(ctx, func(string) string { return f.kind }, []string{g.name + "-i"}, f.pick)
	case faultTermProducer:
		h.terminateProducer(ctx, f)
	case faultRestartFwd:
		h.counted(f.kind, "restart forwarder", h.prod.restart(ctx))
	case faultLeader:
		// Every partition's leader moves at once, as after a broker
		// restart: producers and consumers get NOT_LEADER answers and
		// look the leaders up again mid-flight.
		if h.fake == nil {
			h.fault(f.kind, true)
			return
		}
		h.counted(f.kind, "leader election", h.moveLeaders())
	case faultOversize:
		op, ok := h.prod.(*outboxProducer)
		if !ok {
			h.fault(f.kind, true)
			return
		}
		h.dbGate.RLock()
		h.counted(f.kind, "oversize row", op.writeOversize(ctx))
		h.dbGate.RUnlock()
	case faultOffsetReset:
		h.counted(f.kind, g.name+": offset reset", h.resetOffsets(ctx, g))
	case faultFailover:
		if h.cluster == nil {
			h.fault(f.kind, true)
			return
		}
		h.counted(f.kind, "failover", h.failover(ctx))
	}
}

// counted counts a fault of kind that was injected, or reports what
// failed as a violation.
func (h *harness) counted(kind, what string, err error) {
	if err != nil {
		h.violation("%s: %v", what, err)
		return
	}
	h.fault(kind, false)
}

// armKill arms a live instance of g with the kill f asks for; it is
// counted when the instance executes it.
func (h *harness) armKill(ctx context.Context, g *group, f scheduled) {
	p := pendingKillMid
	switch f.kind {
	case faultKillCommit:
		p = pendingKillCommit
	case faultKillMidCall:
		p = pendingKillMidCall
	}
	if !waitFor(ctx, func() bool { return g.arm(f.pick, p) }) {
		h.fault(f.kind, true)
	}
}

// sigkill kills an instance of g, and its restart: the group rebalances
// twice (the dead member's session expires, its replacement joins). Under
// the group's fault lock, so that no offset reset takes the place of the
// restart; the fault ends once the replacement runs, so that the run
// cannot end before it.
func (h *harness) sigkill(ctx context.Context, g *group, f scheduled) {
	g.faultMu.RLock()
	defer g.faultMu.RUnlock()
	var killed *instance
	if !waitFor(ctx, func() bool { killed = g.killOne(f.pick); return killed != nil }) {
		h.fault(f.kind, true)
		return
	}
	h.kills.Add(1)
	h.fault(f.kind, false)
	h.markKilled(killed)
	select {
	case <-killed.settled:
	case <-ctx.Done():
	}
}

// joinUntil starts an extra instance in g, and stops one once the run's
// progress reached f.until (two rebalances).
func (h *harness) joinUntil(ctx context.Context, g *group, f scheduled) {
	if !h.join(ctx, g) {
		h.fault(f.kind, true)
		return
	}
	h.fault(f.kind, false)
	for h.progress(f) < f.until {
		select {
		case <-ctx.Done():
			h.fault(faultLeave, true)
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	if !h.leave(ctx, g) {
		h.fault(faultLeave, true)
		return
	}
	h.fault(faultLeave, false)
}

// rollingRestart restarts g's instances one after the other, as a
// deployment's rolling update does: each is stopped gracefully (SIGTERM:
// it leaves the group, its partitions move) and a new one started in its
// place, ready before the next is stopped. Under the group's fault lock:
// no offset reset runs meanwhile. An instance that died on its own in the
// meantime is skipped (its replacement is the crash's business).
func (h *harness) rollingRestart(ctx context.Context, g *group) error {
	g.faultMu.RLock()
	defer g.faultMu.RUnlock()
	g.mu.Lock()
	old := slices.Clone(g.live)
	g.mu.Unlock()
	for _, inst := range old {
		select {
		case <-inst.exited:
			continue
		default:
		}
		if ctx.Err() != nil {
			return nil
		}
		inst.stop()
		next, err := g.start(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("start the replacement of %s: %w", inst.name, err)
		}
		if next == nil {
			return nil // the run is over
		}
		h.logf("%s: rolling restart: %s replaced by %s", g.name, inst.name, next.name)
	}
	return nil
}

// terminateProducer terminates a backend of one of the producer's
// components, counted under that component's name.
func (h *harness) terminateProducer(ctx context.Context, f scheduled) {
	prefixes := h.prod.dbComponents()
	h.terminate(ctx, func(target string) string {
		for _, c := range prefixes {
			if target == h.appName(c) {
				return "pg-terminate-" + c
			}
		}
		return f.kind
	}, prefixes, f.pick)
}

// join starts an extra instance in g (a rebalance), under the group's fault
// lock: no offset reset is under way, so g.start starts one (it starts
// none once the run is over). It reports whether one was started.
func (h *harness) join(ctx context.Context, g *group) bool {
	g.faultMu.RLock()
	defer g.faultMu.RUnlock()
	joined, err := g.start(ctx)
	if err != nil {
		h.violation("%s: join: %v", g.name, err)
		return false
	}
	return joined != nil
}

// leave stops an instance of g gracefully (a rebalance) once g runs more
// than its base number: after a crash, that is when the replacement has
// started. It reports false only when ctx ended first.
func (h *harness) leave(ctx context.Context, g *group) bool {
	g.faultMu.RLock()
	defer g.faultMu.RUnlock()
	var leaving *instance
	if !waitFor(ctx, func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		if len(g.live) > g.base && !g.resetting {
			leaving = g.live[len(g.live)-1]
		}
		return leaving != nil
	}) {
		return false
	}
	leaving.stop()
	return true
}

// waitFor retries try until it succeeds (a fault found its target: a live,
// consuming instance, no offset reset under way) or ctx ends.
func waitFor(ctx context.Context, try func() bool) bool {
	for !try() {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
	return true
}

// terminate kills every PostgreSQL backend of one component whose name
// starts with one of prefixes, chosen by pick among those with open
// connections (found by application_name); kind names the fault after the
// chosen one. It retries for a while when none has a connection open (pools
// connect lazily, and reconnect after a kill or a disruption): 10 s, after
// which the fault counts as skipped (a component with no work left keeps no
// connection).
func (h *harness) terminate(ctx context.Context, kind func(target string) string, prefixes []string, pick uint64) {
	h.dbGate.RLock()
	defer h.dbGate.RUnlock()
	like := make([]string, len(prefixes))
	for i, p := range prefixes {
		like[i] = h.appName(p)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var names []string
		rows, err := h.maint.Query(ctx, `SELECT DISTINCT application_name FROM pg_stat_activity WHERE EXISTS (SELECT 1 FROM unnest($1::text[]) p WHERE starts_with(application_name, p)) ORDER BY 1`, like)
		if err == nil {
			names, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			h.violation("%s %v: %v", kind(""), prefixes, err)
			return
		}
		if len(names) > 0 {
			target := names[pick%uint64(len(names))]
			var n int
			err := h.maint.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()`,
				target).Scan(&n)
			if err != nil {
				h.violation("%s %s: %v", kind(target), target, err)
				return
			}
			if n > 0 {
				h.terminated.Add(int64(n))
				h.fault(kind(target), false)
				return
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			h.fault(kind(""), true)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// disrupt takes the run's database away, as a failover or a restart of the
// server would, without touching the rest of the shared server: the database
// stops accepting connections (ALLOW_CONNECTIONS false), every backend on it
// is terminated (the soak's own included), stragglers that connected in
// between are terminated until the outage ends, then connections are
// allowed again.
func (h *harness) disrupt(ctx context.Context) error {
	db := pgx.Identifier{h.dbName}.Sanitize()
	// ALTER DATABASE is retried for a while: it fails with "tuple
	// concurrently updated" (XX000) when autovacuum updates the database's
	// pg_database row at the same moment (seen after a server restart),
	// and the maintenance pool's connections die with a restart.
	alter := func(ctx context.Context, allow bool) error {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return retry(ctx, "alter database", func() error {
			_, err := h.maint.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s WITH ALLOW_CONNECTIONS %t", db, allow))
			return err
		})
	}
	if err := alter(ctx, false); err != nil {
		return err
	}
	start := time.Now()
	var terminated int64
	for {
		var n int64
		// An error here (the maintenance connection died with a server
		// restart) only skips one round of terminations.
		if err := h.maint.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'`,
			h.dbName).Scan(&n); err != nil && ctx.Err() == nil {
			h.logf("disruption: terminate backends: %v", err)
		}
		terminated += n
		if time.Since(start) >= h.cfg.Outage {
			break
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	// Always allow connections again, even when the run is being cancelled.
	aerr := alter(context.WithoutCancel(ctx), true)
	h.terminated.Add(terminated)
	h.disruptions.Add(1)
	h.logf("disruption: database %s refused connections for %s, %d backends terminated", h.dbName, time.Since(start).Round(time.Millisecond), terminated)
	return aerr
}

// resetOffsets stops every instance of g (Kafka only lets an empty group's
// offsets be changed), commits offset 0 on every partition through an
// OffsetManager (works on any Kafka cluster), and starts the instances
// again: the group re-reads the whole topic.
func (h *harness) resetOffsets(ctx context.Context, g *group) error {
	g.faultMu.Lock()
	defer g.faultMu.Unlock()
	n := h.halt(g)
	defer func() {
		g.mu.Lock()
		g.resetting = false
		g.mu.Unlock()
	}()
	h.logf("%s: offset reset: instances stopped", g.name)
	attempt := 0
	err := retry(ctx, "commit offsets", func() error {
		err := h.commitOffsetsToStart(g.name)
		if attempt++; err != nil && attempt%25 == 1 {
			h.logf("%s: offset reset: %v (retrying)", g.name, err)
		}
		return err
	})
	if err != nil {
		return err
	}
	return g.resume(ctx, n)
}

// halt stops every instance of g, the caller holding g's fault lock, and
// returns how many [group.resume] starts again: those live and those
// crashed whose replacement has not started yet (their replacements would
// find the group halted and start none, and the group would shrink for
// good), at least its base number. g stays marked resetting until then.
func (h *harness) halt(g *group) int {
	g.mu.Lock()
	g.resetting = true
	live := append([]*instance(nil), g.live...)
	replaced := g.replacing
	g.replacing = 0
	n := max(len(live)+replaced, g.base)
	g.mu.Unlock()
	for range replaced {
		h.fault(faultRestart, false)
	}
	var wg sync.WaitGroup
	for _, inst := range live {
		wg.Go(inst.stop)
	}
	wg.Wait()
	return n
}

// resume starts instances of g, halted by [harness.halt], until n run.
func (g *group) resume(ctx context.Context, n int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.resetting = false
	for len(g.live) < n {
		if _, err := g.startLocked(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (h *harness) commitOffsetsToStart(groupName string) error {
	client, err := sarama.NewClient(h.brokers, sarama.NewConfig())
	if err != nil {
		return err
	}
	defer client.Close()
	om, err := sarama.NewOffsetManagerFromClient(groupName, client)
	if err != nil {
		return err
	}
	oldest := make([]int64, h.cfg.Partitions)
	for p := range h.cfg.Partitions {
		if oldest[p], err = client.GetOffset(h.topic, p, sarama.OffsetOldest); err != nil {
			_ = om.Close()
			return err
		}
		pom, err := om.ManagePartition(h.topic, p)
		if err != nil {
			_ = om.Close()
			return err
		}
		// Moves the committed offset back (a group without one already
		// starts at the oldest offset: Offsets.Initial = OffsetOldest).
		pom.ResetOffset(oldest[p], "soak: offset reset")
	}
	om.Commit()
	// Close flushes once more and releases the partition managers (their
	// Close would block until then).
	if err := om.Close(); err != nil {
		return err
	}

	// Verify through the admin API: commit errors are only logged by Sarama.
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return err
	}
	parts := make([]int32, h.cfg.Partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := admin.ListConsumerGroupOffsets(groupName, map[string][]int32{h.topic: parts})
	if err != nil {
		return err
	}
	for _, p := range parts {
		b := resp.GetBlock(h.topic, p)
		if b == nil || b.Err != sarama.ErrNoError {
			return fmt.Errorf("partition %d: committed offset not readable", p)
		}
		if b.Offset != oldest[p] && b.Offset != -1 {
			return fmt.Errorf("partition %d: committed offset %d, want %d", p, b.Offset, oldest[p])
		}
	}
	return nil
}

// lag returns the number of records of topic not yet committed by groupName.
// The offsets past the committed one that hold no record a read-committed
// consumer gets (transaction markers, and the records of aborted
// transactions: the transactional forwarder writes both) are not lag: no
// consumer ever commits past them until a later record comes, so a
// partition whose committed offset is followed only by those counts 0.
func (h *harness) lag(groupName, topic string) (int64, error) {
	cfg := sarama.NewConfig()
	cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	client, err := sarama.NewClient(h.brokers, cfg)
	if err != nil {
		return 0, err
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return 0, err
	}
	parts := make([]int32, h.cfg.Partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := admin.ListConsumerGroupOffsets(groupName, map[string][]int32{topic: parts})
	if err != nil {
		return 0, err
	}
	var lag int64
	for _, p := range parts {
		hw, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		committed := int64(0)
		if b := resp.GetBlock(topic, p); b != nil && b.Offset >= 0 {
			committed = b.Offset
		}
		if hw > committed {
			data, err := recordAt(client, topic, p, committed)
			if err != nil {
				return 0, err
			}
			if !data {
				continue
			}
		}
		lag += hw - committed
	}
	return lag, nil
}

// recordAt reports whether a read-committed consumer of topic's partition
// p gets a record at or after offset: false when the offsets from there on
// hold only transaction markers and aborted records. The fetch returns
// whatever the partition has at once; recordAtWait bounds the wait for it.
func recordAt(client sarama.Client, topic string, p int32, offset int64) (bool, error) {
	c, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return false, err
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, p, offset)
	if err != nil {
		return false, err
	}
	defer pc.Close()
	t := time.NewTimer(recordAtWait)
	defer t.Stop()
	select {
	case <-pc.Messages():
		return true, nil
	case err := <-pc.Errors():
		return false, err
	case <-t.C:
		return false, nil
	}
}

// recordAtWait is how long recordAt waits for a fetch that returns no
// record: the broker answers a fetch past the last stable offset after its
// MaxWaitTime (Sarama's default, 500 ms); twice that, for a loaded machine.
const recordAtWait = time.Second

// records returns the number of records on topic (the sum of its
// partitions' high-water marks).
func (h *harness) records(topic string) (int64, error) {
	client, err := sarama.NewClient(h.brokers, sarama.NewConfig())
	if err != nil {
		return 0, err
	}
	defer client.Close()
	var n int64
	for p := range h.cfg.Partitions {
		hw, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		n += hw
	}
	return n, nil
}

// moveLeaders moves the leader of every partition of the run's topics to
// the next of the in-process cluster's three brokers: each one changes.
func (h *harness) moveLeaders() error {
	for _, t := range h.topics {
		for p := range int32(h.cfg.Partitions) {
			next := (h.fake.LeaderFor(t, p) + 1) % leaderBrokers
			if err := h.fake.MoveTopicPartition(t, p, next); err != nil {
				return fmt.Errorf("%s/%d to broker %d: %w", t, p, next, err)
			}
		}
	}
	return nil
}
