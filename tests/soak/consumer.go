package soak

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/childproc"
)

// payload is the JSON body of a soak event.
type payload struct {
	EventID   string `json:"eventId"`
	Aggregate int    `json:"aggregate"`
	Seq       int    `json:"seq"`
	Amount    int64  `json:"amount"`
	// Fail is how many times the handler fails transiently on the event
	// before it succeeds (the plan's failure marks; 0 for most events).
	Fail int `json:"fail,omitempty"`
	// SleepMS is the handler's time on the event (the hot key's events,
	// [Config.HostileKeys]).
	SleepMS int64 `json:"sleepMs,omitempty"`
	// Block marks the failing key's first event: the handler fails on it
	// until the soak releases it.
	Block bool `json:"block,omitempty"`
}

// group is one consumer group: its live consumer processes and counters.
type group struct {
	h    *harness
	idx  int
	name string
	base int // instances it normally runs

	mu        sync.Mutex // guards live, next, resetting, orphans; held across an offset reset
	live      []*instance
	next      int
	resetting bool
	// replacing counts crashed instances whose replacement is still to
	// start (after crashDelay); an offset reset takes them over.
	replacing int
	// orphans are armed faults (pendingKillMid, pendingKillCommit) whose
	// instance ended before it executed them while no other live instance
	// could take them: the next instance started executes one.
	orphans []int32

	// faultMu keeps an offset reset (the writer) apart from the faults
	// that need the group's instances as targets (readers: a kill and its
	// restart, a join, a leave), so that neither finds the group stopped
	// for the other and skips.
	faultMu sync.RWMutex

	deliveries, applied, duplicates, failed atomic.Int64

	// The retry-topic leg (see [GroupReport]).
	retryDeliveries, appliedFromRetry, deferred atomic.Int64
	escalated, poisoned, maxAttempt             atomic.Int64
	maxHandlers                                 atomic.Int64 // the most main-topic messages in one process's handlers at once
	maxSpilled                                  atomic.Int64 // the most spilled records in one process's main-topic subscriber at once
	escalatedIDs                                sync.Map     // event id → true
	escalations                                 sync.Map     // event id → *tailBuffer: its escalations and their causes
	poisonedIDs                                 sync.Map     // share-group leg: event id → *poisoning
}

// poisoning is what the share-group leg's poison lines told of one
// event: how many times it was poisoned (once per record of it: a double
// publish is poisoned twice; a kill between the poison queue's publish
// and the ack makes it once more), and the lines.
type poisoning struct {
	mu    sync.Mutex
	lines []string
}

func (p *poisoning) add(line string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lines = append(p.lines, line)
}

func (p *poisoning) all() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.lines)
}

// retryGroup is the Kafka consumer group of a group's consumers of retry
// topic i (the dedup consumer group stays the group's name).
func retryGroup(group string, i int) string { return fmt.Sprintf("%s-retry%d", group, i+1) }

// inProcessRetries is the MaxRetries of each group's watermill Retry, inside
// the retry-topic middleware: the first group retries once in process (an
// event planned to fail once never leaves its partition, one failing 2 or 3
// times goes to a retry topic once), the second not at all (every failure
// goes to a retry topic: attempts 1 to 3, over both retry topics).
var inProcessRetries = [2]int{1, 0}

// Pending faults a consumer executes on its next applied message.
const (
	pendingNone int32 = iota
	pendingKillMid
	pendingKillCommit
	pendingKillMidCall // lease mode: while a call to the provider is in flight
)

// instance is one consumer process.
type instance struct {
	g  *group
	id int
	// slot is the lowest slot free at its start (freeSlotLocked): its
	// static member's name with Config.Static.
	slot    int
	name    string
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	pending atomic.Int32 // fault armed in the process, not yet executed
	// consuming is set at the process's first delivery: it has completed
	// a JoinGroup and a SyncGroup and owns partitions.
	consuming atomic.Bool
	// joined is set once every consumer group of the process (the main
	// topic's and the retry topics') has completed its first join.
	joined atomic.Bool
	// expected is set before the process ends on purpose: "stop" (SIGTERM,
	// graceful), "sigkill" (the soak killed it) or a fault kind (it killed
	// itself). Any other end is a violation.
	expected atomic.Value
	ready    chan struct{}
	exited   chan struct{}
	// settled is closed once the soak has handled the process's end
	// (a crashed instance's replacement is started, or was not needed).
	settled chan struct{}
	stderr  *tailBuffer
}

type stateKey struct{}

// delivery is shared by the outer middleware, the per-attempt middleware
// and the handler through the message context (the retry-topic and dedup
// middlewares keep the context's values): reached, the chain inside the
// retry-topic middleware ran; err, how its last attempt ended; ran, the
// handler of the last attempt got through.
type delivery struct {
	reached, ran bool
	err          error
}

// start starts a consumer process and waits until its router runs. It
// starts none (nil) during an offset reset, which starts the instances
// again itself, or once the run is over.
func (g *group) start(ctx context.Context) (*instance, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.resetting || g.h.closing.Load() {
		return nil, nil
	}
	return g.startLocked(ctx)
}

// startLocked is start with g.mu held.
func (g *group) startLocked(ctx context.Context) (*instance, error) {
	h := g.h
	g.next++
	inst := &instance{g: g, id: g.next, slot: g.freeSlotLocked(), ready: make(chan struct{}), exited: make(chan struct{}), settled: make(chan struct{}), stderr: &tailBuffer{max: 20}}
	inst.name = fmt.Sprintf("%s-i%d", g.name, inst.id)
	p, err := childproc.Start(h.exe, ConsumerEnv, g.childConfig(inst))
	if err != nil {
		return nil, err
	}
	cmd, stdout, stderr := p.Cmd, p.Stdout, p.Stderr
	inst.stdin = p.Stdin
	inst.cmd = cmd
	var pipes sync.WaitGroup
	pipes.Go(func() { inst.readStdout(stdout) })
	pipes.Go(func() { inst.readStderr(stderr) })
	h.bg.Go(func() {
		pipes.Wait() // Wait closes the pipes: read them to the end first
		err := cmd.Wait()
		close(inst.exited)
		defer close(inst.settled)
		g.exited(ctx, inst, err)
	})
	select {
	case <-inst.ready:
	case <-inst.exited:
		return nil, fmt.Errorf("consumer %s exited before it was ready: %s", inst.name, inst.stderr)
	case <-ctx.Done():
		inst.kill("stop")
		return nil, ctx.Err()
	}
	g.live = append(g.live, inst)
	if n := len(g.orphans); n > 0 && inst.arm(g.orphans[n-1]) {
		g.orphans = g.orphans[:n-1]
	}
	return inst, nil
}

// instanceID is inst's static member name with Config.Static, else "".
func (g *group) instanceID(inst *instance) string {
	if !g.h.cfg.Static {
		return ""
	}
	return fmt.Sprintf("%s-slot%d", g.name, inst.slot)
}

// freeSlotLocked is the lowest slot no live instance of g holds (g.mu
// held): a process that replaces a killed or stopped one takes its slot.
func (g *group) freeSlotLocked() int {
	for slot := 0; ; slot++ {
		if !slices.ContainsFunc(g.live, func(x *instance) bool { return x.slot == slot }) {
			return slot
		}
	}
}

// childConfig is the configuration of inst, a consumer process of g.
func (g *group) childConfig(inst *instance) childConfig {
	h := g.h
	maxConns := int32(4)
	if h.cfg.UnsafeLedgerOutsideTx {
		// Each concurrently handled partition (of the main topic and of
		// each retry topic) holds a transaction and needs a second
		// connection for the unsafe write.
		maxConns = h.cfg.Partitions*int32(1+len(h.retryTopics(g.idx))) + 2
	}
	retryTopics := h.retryTopics(g.idx)
	if h.cfg.Share {
		retryTopics = nil // the broker redelivers
	}
	if (h.cfg.Parallel || h.cfg.Engine == EngineFranz) && !h.cfg.GroupCommit && !h.cfg.Lease {
		// One transaction per message in flight (idem.Config.Concurrency
		// declares it; NewDedup refuses a smaller pool). With group
		// commit the groups' 4 connections suffice.
		maxConns = int32(ParallelMaxInFlight + len(retryTopics)*ParallelRetryMaxInFlight)
	}
	return childConfig{
		DatabaseURL: h.cfg.DatabaseURL,
		Database:    h.dbName,
		Schema:      h.schema,
		AppName:     h.appName(inst.name),
		Brokers:     h.brokers,
		Topic:       h.topic,
		DLQ:         h.dlq,
		RetryTopics: retryTopics,
		PoisonTopic: h.poisonTopic(g.idx),
		Retries:     inProcessRetries[g.idx%len(inProcessRetries)],
		Group:       g.name,
		Instance:    inst.name,
		CopyToDLQ:   g.idx == 0 && h.cfg.DLQPercent > 0,
		Unsafe:      h.cfg.UnsafeLedgerOutsideTx,
		MaxConns:    maxConns,
		Verbose:     h.cfg.ConsumerLogs,
		GroupCommit: h.cfg.GroupCommit,
		Parallel:    h.cfg.Parallel,
		Engine:      h.cfg.Engine,
		// GroupProtocol is "" on the Sarama engine.
		GroupProtocol: h.cfg.GroupProtocol,
		Share:         h.cfg.Share,
		InstanceID:    g.instanceID(inst),
		// Lease mode: the middleware's phases need 2 x 1 + 1 connections
		// (LeaseConfig.Concurrency 1), whatever the messages in flight; the
		// fourth serves KeyOrder's parked-keys checks.
		Lease:           h.cfg.Lease,
		LeaseDuration:   h.cfg.LeaseDuration,
		ProviderURL:     h.providerURL(),
		UnstableKey:     h.cfg.UnstableIdempotencyKey,
		FailingKey:      h.failingKey(),
		PartitionWindow: h.partitionWindow(),
		Sticky:          h.cluster != nil && h.cfg.Parallel,
		Progress:        h.cluster != nil && !h.cfg.SkipProgress,
		SkipProgress:    h.cfg.SkipProgress,
		KeepsPosition:   h.cfg.SubscriberProgress,
	}
}

// failingKey is the failing key's partition key, "" without hostile keys.
func (h *harness) failingKey() string {
	if !h.cfg.HostileKeys {
		return ""
	}
	return keyOf(failingAggregate(h.cfg))
}

// partitionWindow is the main topic subscriber's PartitionWindow: 0 (its
// default) without hostile keys.
func (h *harness) partitionWindow() int {
	if !h.cfg.HostileKeys {
		return 0
	}
	return HostilePartitionWindow
}

// readStdout turns the process's protocol lines into counters and faults.
func (inst *instance) readStdout(r io.Reader) {
	g, h := inst.g, inst.g.h
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == lineDelivery:
			g.deliveries.Add(1)
			inst.consuming.Store(true)
		case line == lineDeliveryRetry:
			g.deliveries.Add(1)
			g.retryDeliveries.Add(1)
			inst.consuming.Store(true)
		case line == lineApplied:
			g.applied.Add(1)
		case line == lineAppliedRetry:
			g.applied.Add(1)
			g.appliedFromRetry.Add(1)
		case line == lineDeferred:
			g.deferred.Add(1)
		case strings.HasPrefix(line, lineEscalated):
			attempt, rest, _ := strings.Cut(strings.TrimPrefix(line, lineEscalated), " ")
			id, cause, _ := strings.Cut(rest, " ")
			g.escalated.Add(1)
			g.escalatedIDs.Store(id, true)
			g.noteEscalation(id, fmt.Sprintf("%s attempt %s from %s: %s", inst.name, attempt, cause, time.Now().Format("15:04:05.000")))
			if n, err := strconv.ParseInt(attempt, 10, 64); err == nil {
				for {
					m := g.maxAttempt.Load()
					if n <= m || g.maxAttempt.CompareAndSwap(m, n) {
						break
					}
				}
			}
		case strings.HasPrefix(line, lineHandlers):
			if n, err := strconv.ParseInt(strings.TrimPrefix(line, lineHandlers), 10, 64); err == nil {
				for m := g.maxHandlers.Load(); n > m && !g.maxHandlers.CompareAndSwap(m, n); m = g.maxHandlers.Load() {
				}
			}
		case strings.HasPrefix(line, lineSpilled):
			if n, err := strconv.ParseInt(strings.TrimPrefix(line, lineSpilled), 10, 64); err == nil {
				for m := g.maxSpilled.Load(); n > m && !g.maxSpilled.CompareAndSwap(m, n); m = g.maxSpilled.Load() {
				}
			}
		case strings.HasPrefix(line, linePoisoned):
			g.poisoned.Add(1)
			p := strings.TrimPrefix(line, linePoisoned)
			id, _, _ := strings.Cut(p, " ")
			if h.cfg.Share {
				// The share-group leg poisons its planned poison events:
				// verify checks which were.
				v, _ := g.poisonedIDs.LoadOrStore(id, &poisoning{})
				v.(*poisoning).add(p)
				continue
			}
			h.violation("%s: poisoned (the retry path gave up): %s; its escalations: %s", inst.name, p, g.escalationsOf(id))
		case line == lineDuplicate:
			g.duplicates.Add(1)
		case line == lineFailed:
			g.failed.Add(1)
		case strings.HasPrefix(line, lineDLQ):
			h.dlqSentIDs.Store(strings.TrimPrefix(line, lineDLQ), true)
		case line == lineJoined:
			inst.joined.Store(true)
		case line == lineReady:
			close(inst.ready)
		case strings.HasPrefix(line, lineKill):
			kind := strings.TrimPrefix(line, lineKill)
			inst.expected.Store(kind)
			inst.pending.Store(pendingNone)
			h.fault(kind, false)
			h.kills.Add(1)
			h.markKilled(inst)
		case strings.HasPrefix(line, lineViolation):
			h.violation("%s: %s", inst.name, strings.TrimPrefix(line, lineViolation))
		}
	}
}

// readStderr keeps the process's last log lines (for an unexpected exit),
// counts the "i/o timeout" errors that mark a consumer group that cannot
// re-form (a JoinGroup response not awaited long enough), and forwards
// the logs when the run is verbose.
func (inst *instance) readStderr(r io.Reader) {
	h := inst.g.h
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		inst.stderr.add(line)
		if strings.Contains(line, "i/o timeout") {
			h.ioTimeouts.Add(1)
		}
		if h.cfg.ConsumerLogs {
			h.logf("%s: %s", inst.name, line)
		}
	}
}

// exited runs when a consumer process has ended: it leaves the group's live
// list, hands an unexecuted fault to another instance and, after a crash,
// starts a replacement (the orchestrator restarting the pod).
func (g *group) exited(ctx context.Context, inst *instance, err error) {
	h := g.h
	g.mu.Lock()
	for i, x := range g.live {
		if x == inst {
			g.live = append(g.live[:i], g.live[i+1:]...)
			break
		}
	}
	g.mu.Unlock()
	if p := inst.pending.Swap(pendingNone); p != pendingNone {
		g.rearm(inst, p) // armed but never executed
	}
	expected, _ := inst.expected.Load().(string)
	killed := false
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			killed = true
		}
	}
	switch {
	case expected == "stop":
		return // stopped on purpose (a leave, an offset reset, the end of the run)
	case killed && expected != "":
		// crashed on purpose: restart below
	case killed:
		h.violation("%s: killed by a SIGKILL the soak did not send (out of memory?)", inst.name)
	default:
		h.violation("%s: exited unexpectedly (%v): %s", inst.name, err, inst.stderr)
	}
	if h.closing.Load() {
		return
	}
	delay := h.crashDelay()
	if expected == faultCrashLoop {
		delay = crashLoopBackoff
	}
	g.mu.Lock()
	g.replacing++
	g.mu.Unlock()
	select {
	case <-time.After(delay):
	case <-ctx.Done():
		return
	}
	g.mu.Lock()
	if g.replacing == 0 || g.resetting || h.closing.Load() {
		// An offset reset took the replacement over (it starts as many
		// instances as were live plus those being replaced), or the run
		// is over.
		g.mu.Unlock()
		return
	}
	g.replacing--
	next, err := g.startLocked(ctx)
	g.mu.Unlock()
	switch {
	case err != nil && !h.closing.Load() && ctx.Err() == nil:
		h.violation("%s: restart after crash: %v", g.name, err)
	case next != nil && err == nil:
		h.fault(faultRestart, false)
	}
}

// kill ends the process with SIGKILL; why is recorded as expected.
func (inst *instance) kill(why string) {
	inst.expected.Store(why)
	_ = inst.cmd.Process.Kill()
}

// stop ends the process gracefully (SIGTERM: the router closes, the consumer
// leaves its group, in-flight messages are not acked) and waits for it.
func (inst *instance) stop() {
	h := inst.g.h
	inst.expected.Store("stop")
	h.stopped.Store(inst.name, time.Now())
	start := time.Now()
	_ = inst.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-inst.exited:
	case <-time.After(MaxStopWait):
		h.violation("%s: no exit %s after SIGTERM (a consumer stops within its RevokeTimeout and the router's CloseTimeout); its last log lines: %s",
			inst.name, MaxStopWait, inst.stderr)
		h.dumpStall()
		time.Sleep(time.Second) // the goroutine dump is written before the kill
		_ = inst.cmd.Process.Kill()
		<-inst.exited
	}
	took := time.Since(start)
	h.stops.Add(1)
	for m := h.maxStop.Load(); int64(took) > m && !h.maxStop.CompareAndSwap(m, int64(took)); m = h.maxStop.Load() {
	}
}

// MaxStopWait bounds a consumer's exit after SIGTERM: idemkafka's
// RevokeTimeout (10 s: the partitions' messages in flight) and the router's
// CloseTimeout (20 s: its handlers), with room for a rebalance the member
// leaves in the middle of. A consumer that takes longer is a violation.
const MaxStopWait = 45 * time.Second

// tailBuffer keeps the last max lines written to it.
type tailBuffer struct {
	mu    sync.Mutex
	max   int
	lines []string
	// crash is the head of a Go crash report (its "panic:" or "fatal
	// error:" line and the frames after it), which the tail would lose to
	// the other goroutines' stacks.
	crash []string
}

// crashHead is how many lines of a crash report's head are kept.
const crashHead = 16

func (b *tailBuffer) add(line string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case len(b.crash) == 0 && (strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "fatal error: ")):
		b.crash = append(b.crash, line)
	case len(b.crash) > 0 && len(b.crash) < crashHead:
		b.crash = append(b.crash, line)
	}
	b.lines = append(b.lines, line)
	if len(b.lines) > b.max {
		b.lines = b.lines[len(b.lines)-b.max:]
	}
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.lines) == 0 {
		return "(no output)"
	}
	if len(b.crash) > 0 {
		return "crash: " + strings.Join(b.crash, " | ") + " || last lines: " + strings.Join(b.lines, " | ")
	}
	return strings.Join(b.lines, " | ")
}

// noteEscalation records one escalation of event id (the last 12 are kept).
func (g *group) noteEscalation(id, what string) {
	b, _ := g.escalations.LoadOrStore(id, &tailBuffer{max: 12})
	b.(*tailBuffer).add(what)
}

// escalationsOf returns event id's recorded escalations.
func (g *group) escalationsOf(id string) string {
	if b, ok := g.escalations.Load(id); ok {
		return b.(*tailBuffer).String()
	}
	return "(none recorded)"
}
