package soak

import (
	"context"
	"io"
	"time"

	"github.com/IBM/sarama"
)

// rearm hands a fault that an ending instance did not execute to another
// live instance or, when none can take it, to the next instance started
// (see [group.orphans]). Once the run is over it counts as skipped.
func (g *group) rearm(from *instance, p int32) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.h.closing.Load() {
		g.h.fault(g.h.pendingKind(p), true)
		return
	}
	for _, inst := range g.live {
		if inst != from && inst.arm(p) {
			return
		}
	}
	g.orphans = append(g.orphans, p)
}

// skipOrphans counts the armed faults no instance executed before the end
// of the run as skipped.
func (g *group) skipOrphans() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, p := range g.orphans {
		g.h.fault(g.h.pendingKind(p), true)
	}
	g.orphans = nil
}

// pendingKind is the fault kind of an armed fault. In lease mode the
// handler has no transaction: the mid-handler kill lands after the call,
// before the completion.
func (h *harness) pendingKind(p int32) string {
	switch {
	case p == pendingKillCommit:
		return faultKillCommit
	case p == pendingKillMidCall:
		return faultKillMidCall
	case h.cfg.Lease:
		return faultKillAfterCall
	}
	return faultKillMid
}

// arm hands fault p to a live instance (chosen by pick) that has none
// pending; it executes it on its next applied message.
func (g *group) arm(pick uint64, p int32) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.resetting {
		return false
	}
	for i := range g.live {
		if g.live[(int(pick%uint64(len(g.live)))+i)%len(g.live)].arm(p) {
			return true
		}
	}
	return false
}

func (inst *instance) arm(p int32) bool {
	if !inst.pending.CompareAndSwap(pendingNone, p) {
		return false
	}
	cmd := cmdKillMid
	switch p {
	case pendingKillCommit:
		cmd = cmdKillCommit
	case pendingKillMidCall:
		cmd = cmdKillCall
	}
	if _, err := io.WriteString(inst.stdin, cmd+"\n"); err != nil {
		inst.pending.Store(pendingNone) // the process is ending
		return false
	}
	return true
}

// killOne sends SIGKILL to a consuming instance chosen by pick, at whatever
// point it is (fetching, inside a transaction, committing, between commit
// and ack, holding a retry copy, rejoining during a rebalance). Instances
// that have not consumed yet, or one of whose consumer groups has not
// completed its first join, are not chosen: killing one that never
// finished its first join is the crash-loop fault's business (see
// [group.crashLoop] and [sessionTracer]). It returns the instance killed,
// or nil when none is consuming (or an offset reset is under way).
func (g *group) killOne(pick uint64) *instance {
	g.mu.Lock()
	defer g.mu.Unlock()
	var consuming []*instance
	for _, inst := range g.live {
		if inst.consuming.Load() && inst.joined.Load() {
			consuming = append(consuming, inst)
		}
	}
	if g.resetting || len(consuming) == 0 {
		return nil
	}
	inst := consuming[int(pick%uint64(len(consuming)))]
	inst.kill(faultSigkill)
	return inst
}

// crashLoopBackoff is how long an instance killed while joining stays down:
// Kubernetes' first CrashLoopBackOff delay.
const crashLoopBackoff = 10 * time.Second

// crashLoop starts a new instance (scaling out) and kills it with SIGKILL
// while its first JoinGroup is held by the coordinator: the group forms with
// a member that is already dead. Its replacement starts after
// [crashLoopBackoff] and joins while the dead member is still in the group,
// so the coordinator holds every member's JoinGroup until the rebalance
// timeout removes the dead one. That is the wait a consumer must sit
// through: with a Net.ReadTimeout shorter than
// Consumer.Group.Rebalance.Timeout the joins time out, the members leave
// and join again, and the group does not re-form.
//
// It reports false when it started nothing (an offset reset is under way).
func (g *group) crashLoop(ctx context.Context) (bool, error) {
	inst, err := g.start(ctx)
	if err != nil || inst == nil {
		return false, err
	}
	g.killWhileJoining(ctx, inst)
	return true, nil
}

// killWhileJoining sends SIGKILL to inst once its consumer group is
// rebalancing, which a new member's JoinGroup starts: the process dies while
// the coordinator holds its join. The group's state comes from the Kafka
// admin API (DescribeGroups), so this works on any cluster. If the group is
// not seen rebalancing within 20 s, inst is killed anyway.
func (g *group) killWhileJoining(ctx context.Context, inst *instance) {
	h := g.h
	joining := false
	admin, err := sarama.NewClusterAdmin(h.brokers, sarama.NewConfig())
	if err == nil {
		defer admin.Close()
		deadline := time.Now().Add(20 * time.Second)
		for !joining && time.Now().Before(deadline) && ctx.Err() == nil {
			ds, err := admin.DescribeConsumerGroups([]string{g.name})
			if err == nil && len(ds) == 1 && (ds[0].State == "PreparingRebalance" || ds[0].State == "CompletingRebalance") {
				joining = true
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if !joining {
		h.logf("%s: crash loop: group %s not seen rebalancing (%v); killing the replacement anyway", inst.name, g.name, err)
	}
	inst.kill(faultCrashLoop)
	h.markKilled(inst)
}
