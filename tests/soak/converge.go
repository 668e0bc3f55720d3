package soak

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

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
		if why := h.blockedReason(g); why != "" {
			return false, why
		}
		n, err := h.appliedEvents(ctx, g)
		if err != nil {
			return false, err.Error()
		}
		if want := h.cfg.Events - h.report.PoisonEvents; n < want {
			return false, fmt.Sprintf("%s applied %d of %d events", g.name, n, want)
		}
		if p := countMap(&g.poisonedIDs); p < h.report.PoisonEvents {
			return false, fmt.Sprintf("%s poisoned %d of %d poison events", g.name, p, h.report.PoisonEvents)
		}
	}
	if missing, sent := h.dlqMissing(); len(missing) > 0 {
		return false, fmt.Sprintf("dlq replayed %d of %d events", sent-len(missing), sent)
	}
	if lag, err := h.lag("soak-dlq-replay-"+h.runID, h.dlq); err != nil || lag > 0 {
		return false, fmt.Sprintf("dlq replayer lag %d (%v)", lag, err)
	}
	for _, g := range h.groups {
		if h.cfg.Share {
			// A share group commits no offsets, and consumes no retry
			// topic: the ledger and the poison queue tell.
			continue
		}
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

// countMap counts m's entries.
func countMap(m *sync.Map) (n int) {
	m.Range(func(any, any) bool { n++; return true })
	return n
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
	names := h.consumerGroupNames()
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
		if why := h.blockedReason(g); why != "" {
			h.logf("stuck: %s", why)
		}
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
