package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
)

// fastBatch is one take on the fast path ([LeaseConfig.FastPath]): a
// transaction that holds its owned events by advisory locks while their
// handlers run, and then writes, in one commit, the claims (and writes) of
// the handlers that returned and the lease rows of those still running.
// It holds the take batcher's slot until then, so lease mode's
// connections stay 2 × Concurrency + 1.
type fastBatch struct {
	l       *leaseMode
	ctx     context.Context // bounded by LeaseConfig.Duration
	cancel  context.CancelFunc
	tx      pgx.Tx
	release func() // the take batcher's slot
	timer   *time.Timer
	done    chan struct{} // closed once the batch committed or failed
	// unpipelined: a pipelined write was refused (errPipelineRefused);
	// the batch's next writes send the statements one by one.
	unpipelined bool

	mu      sync.Mutex
	members []*fastMember
	running int  // members whose handlers have not reported
	closed  bool // the batch is finishing: members' states are final
}

// memberState is where a fast-path member stands.
type memberState int

const (
	memberRunning  memberState = iota // its handler runs, no lease row
	memberFinished                    // returned nil: claimed with the batch
	memberFailed                      // returned an error: nothing written
	memberLeased                      // still running at the deadline: a lease row
)

// fastMember is one owned event of a fastBatch.
type fastMember struct {
	b         *fastBatch
	id, token uuid.UUID
	takenOver bool // an expired lease, replaced by the batch's writes
	state     memberState
	c         *completeReq // memberFinished: the completion to write

	// Set by attach, and by the batch once it committed: leased runs
	// onLeased (the renewals start); lost cancels the handler.
	onLeased func()
	cancel   context.CancelCauseFunc
	leased   bool
	lost     bool
}

// fastGate decides whether a take opens the fast path. It does while most
// recent handlers returned within FastPath: the members of fast batches,
// and, while it is closed, the handlers of takes that wrote lease rows
// (their calls are timed too). So slow handlers turn it off, and quick ones
// turn it back on, without a probe: a take that opened the fast path to
// see whether handlers sped up would hold a transaction open across a
// slow call, idle for as long as the call, or as the process is not
// scheduled.
type fastGate struct {
	mu    sync.Mutex
	share float64 // moving average of the share of handlers done within FastPath
}

const (
	fastMinShare = 0.5
	fastWeight   = 0.2 // of the latest batch (or lease-row call) in the moving average
)

func newFastGate() *fastGate { return &fastGate{share: 1} }

// open reports whether the next take opens the fast path.
func (g *fastGate) open() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.share >= fastMinShare
}

// record adds a fast batch of members, of which done returned (or
// failed) within FastPath; or one call of a take that wrote a lease row
// (members 1, done 1 when it returned within FastPath).
func (g *fastGate) record(done, members int) {
	if members == 0 {
		return
	}
	g.mu.Lock()
	g.share = (1-fastWeight)*g.share + fastWeight*float64(done)/float64(members)
	g.mu.Unlock()
}

// openFast opens a fast-path transaction for batch: the take's state read
// under the events' advisory locks. Done and busy events are answered at
// once; owned ones get a member and their handlers run while the
// transaction stays open, until all of them reported or FastPath passed.
func (l *leaseMode) openFast(batch []*takeReq, release func()) {
	defer func() {
		for _, t := range batch {
			close(t.done)
		}
	}()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(batch[0].ctx), l.cfg.Duration)
	tx, takes, err := l.proto.Open(ctx, l.db, takeRequests(batch), l.cfg.Duration)
	if err != nil {
		if tx != nil {
			_ = tx.Rollback(ctx)
		}
		cancel()
		release()
		for _, t := range batch {
			t.err = fmt.Errorf("take lease: %w", err)
		}
		return
	}
	b := &fastBatch{l: l, ctx: ctx, cancel: cancel, tx: tx, release: release, done: make(chan struct{})}
	for i, t := range batch {
		t.res = takes[i]
		if takes[i].State == leasesql.Owned {
			t.member = &fastMember{b: b, id: t.req.EventID, token: t.req.Token, takenOver: takes[i].TakenOver}
			b.members = append(b.members, t.member)
		}
	}
	b.running = len(b.members)
	if b.running == 0 {
		_ = tx.Rollback(ctx)
		cancel()
		release()
		return
	}
	b.mu.Lock()
	b.timer = time.AfterFunc(l.cfg.FastPath, b.deadline)
	b.mu.Unlock()
}

// attach gives m its handler's renewal start and cancel. The batch may
// have written m's lease row already (a handler that started late): then
// the renewals start now.
func (m *fastMember) attach(onLeased func(), cancel context.CancelCauseFunc) {
	b := m.b
	b.mu.Lock()
	m.onLeased, m.cancel = onLeased, cancel
	leased, lost := m.leased, m.lost
	b.mu.Unlock()
	switch {
	case leased:
		onLeased()
	case lost:
		cancel(ErrLeaseLost)
	}
}

// report tells the batch m's handler returned: c is its completion, nil
// after an error. It returns once the batch is done, and reports whether
// the batch settled m (c's result is set; after an error nothing was
// written). false: m was given a lease row at the deadline (or lost it,
// and its handler's context says so) and goes on as a leased delivery.
func (m *fastMember) report(c *completeReq) (settled bool) {
	b := m.b
	b.mu.Lock()
	if m.state != memberRunning {
		b.mu.Unlock()
		<-b.done
		return false
	}
	m.state, m.c = memberFailed, c
	if c != nil {
		m.state = memberFinished
	}
	b.running--
	last := b.running == 0
	if last {
		b.closed = true
		b.timer.Stop()
	}
	b.mu.Unlock()
	if last {
		b.finish()
	}
	<-b.done
	return true
}

// deadline runs at FastPath: the members still running get lease rows,
// and the batch finishes.
func (b *fastBatch) deadline() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	b.closed = true
	for _, m := range b.members {
		if m.state == memberRunning {
			m.state = memberLeased
		}
	}
	b.mu.Unlock()
	b.finish()
}

// finish writes the batch and commits it. A member whose writes fail gets
// its error and the batch is written again without it, in a new
// transaction that takes the locks and reads the states anew (they were
// free while no transaction held them).
func (b *fastBatch) finish() {
	defer b.release()
	defer b.cancel()
	defer close(b.done)
	var live []*fastMember
	leased := 0
	for _, m := range b.members {
		if m.state == memberFinished || m.state == memberLeased {
			live = append(live, m)
		}
		if m.state == memberLeased {
			leased++
		}
	}
	b.l.fast.record(len(b.members)-leased, len(b.members))
	for {
		failed, err := b.write(live)
		if failed == nil && !errors.Is(err, leasesql.ErrNotAllHeld) && !errors.Is(err, errPipelineRefused) {
			b.settle(live, err)
			return
		}
		// A member's write failed (it has its error), or an event was
		// claimed by another mode meanwhile (the new transaction's state
		// read settles it as a duplicate), or a statement was refused (the
		// next write sends them one by one, and finds whose): the others
		// are written anew.
		if errors.Is(err, errPipelineRefused) {
			b.unpipelined = true
		}
		live = slices.DeleteFunc(live, func(m *fastMember) bool { return m == failed })
		if live, err = b.reopen(live); err != nil {
			b.settle(live, err)
			return
		}
		if len(live) == 0 {
			return
		}
	}
}

// write runs the batch's writes in b.tx and commits. failed is a member
// whose own writes failed (the transaction is rolled back; the others are
// to be written again), with its error set; err is the batch's failure,
// or [leasesql.ErrNotAllHeld] from the pipelined write (rolled back:
// write the batch again). When every finished member's writes are
// [CompleteExec] statements, they travel in one pipeline with the
// batch's own statements: two round trips with the COMMIT, however many
// members.
func (b *fastBatch) write(live []*fastMember) (failed *fastMember, err error) {
	l := b.l
	committed := false
	defer func() {
		if !committed {
			_ = b.tx.Rollback(b.ctx)
		}
	}()
	var finished, takenOver []uuid.UUID
	var fin []*fastMember
	var leased []leasesql.Request
	for _, m := range live {
		if m.state == memberLeased {
			leased = append(leased, leasesql.Request{EventID: m.id, Token: m.token})
			continue
		}
		fin, finished = append(fin, m), append(finished, m.id)
		if m.takenOver {
			takenOver = append(takenOver, m.id)
		}
	}
	if !b.unpipelined && l.pipelined(completions(fin)) {
		if failed, err := b.writePipelined(fin, finished, takenOver, leased); failed != nil || err != nil {
			return failed, err
		}
		if err := b.tx.Commit(b.ctx); err != nil {
			return nil, fmt.Errorf("dedup: complete: commit: %w", err)
		}
		committed = true
		return nil, nil
	}
	res, err := l.proto.Finish(b.ctx, b.tx, finished, takenOver, leased, l.cfg.Duration, l.cfg.Owner)
	if err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	hooks := &idemctx.Hooks{Tx: b.tx}
	for i, m := range fin {
		m.c.result = res[i]
		if res[i] != leasesql.Completed {
			continue
		}
		if werr := l.write(m.c, b.tx, hooks); werr != nil {
			m.c.result, m.c.out, m.c.err = 0, nil, werr
			if len(live) > 1 {
				l.s.stats.groupFallbacks.Add(1)
			}
			return m, nil
		}
	}
	for _, id := range finished {
		l.hook("completing", id)
	}
	if err := b.tx.Commit(b.ctx); err != nil {
		// The outcome is unknown: the redeliveries' takes tell.
		return nil, fmt.Errorf("dedup: complete: commit: %w", err)
	}
	committed = true
	hooks.Committed()
	return nil, nil
}

// completions returns the completions of fin.
func completions(fin []*fastMember) []*completeReq {
	cs := make([]*completeReq, len(fin))
	for i, m := range fin {
		cs[i] = m.c
	}
	return cs
}

// writePipelined sends the batch's statements (the claims, which must all
// be new, the take-overs, the leases of the running) and the finished
// members' [CompleteExec] statements in one round trip in b.tx, not
// committed. failed and err as in write; the caller rolls back on either.
func (b *fastBatch) writePipelined(fin []*fastMember, finished, takenOver []uuid.UUID, leased []leasesql.Request) (failed *fastMember, err error) {
	l := b.l
	batch := &pgx.Batch{}
	read := l.proto.QueueFinishAll(batch, finished, takenOver, leased, l.cfg.Duration, l.cfg.Owner)
	own := batch.Len()
	for _, m := range fin {
		for _, w := range m.c.writes {
			batch.Queue(w.sql, w.args...)
		}
	}
	for _, id := range finished {
		l.hook("completing", id)
	}
	if batch.Len() == 0 {
		return nil, nil
	}
	br := b.tx.SendBatch(b.ctx, batch)
	defer br.Close()
	if err := read(br); err != nil {
		if errors.Is(err, leasesql.ErrNotAllHeld) {
			return nil, err
		}
		if refused(err, batch.Len()-own) {
			return nil, errPipelineRefused
		}
		return nil, fmt.Errorf("dedup: %w", err)
	}
	for _, m := range fin {
		for i := range m.c.writes {
			if _, err := br.Exec(); err != nil {
				m.c.result, m.c.out, m.c.err = 0, nil, fmt.Errorf("dedup: idem.CompleteExec statement %d of event %s: %w", i+1, m.id, err)
				if len(fin) > 1 || len(leased) > 0 {
					l.s.stats.groupFallbacks.Add(1)
				}
				return m, nil
			}
		}
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	for _, m := range fin {
		m.c.result = leasesql.Completed
		m.c.out, _ = l.s.toOutbox(m.c.origCtx, m.c.origCtx, nil, m.c.produced)
	}
	return nil, nil
}

// reopen begins a new transaction for live after a member's failure and
// returns the members still free to write: a finished member whose event
// is now done or leased by another delivery is settled (duplicate, lost),
// a leased member whose event is no longer free loses its lease.
func (b *fastBatch) reopen(live []*fastMember) ([]*fastMember, error) {
	if len(live) == 0 {
		return nil, nil
	}
	reqs := make([]leasesql.Request, len(live))
	for i, m := range live {
		reqs[i] = leasesql.Request{EventID: m.id, Token: m.token}
	}
	tx, takes, err := b.l.proto.Open(b.ctx, b.l.db, reqs, b.l.cfg.Duration)
	if err != nil {
		if tx != nil {
			_ = tx.Rollback(b.ctx)
		}
		return live, fmt.Errorf("dedup: take lease: %w", err)
	}
	b.tx = tx
	var still []*fastMember
	for i, m := range live {
		switch {
		case takes[i].State == leasesql.Owned:
			m.takenOver = takes[i].TakenOver
			still = append(still, m)
		case m.state == memberFinished && takes[i].State == leasesql.Done:
			m.c.result = leasesql.Duplicate
		case m.state == memberFinished:
			m.c.result = leasesql.Lost
		default:
			b.lose(m)
		}
	}
	if len(still) == 0 {
		_ = tx.Rollback(b.ctx)
	}
	return still, nil
}

// settle records the batch's outcome: err, or success. The leased
// members' renewals start; after a failure they lose the lease (it may
// not exist) and their handlers are cancelled.
func (b *fastBatch) settle(live []*fastMember, err error) {
	for _, m := range live {
		switch {
		case m.state == memberFinished && err != nil:
			m.c.err = err
		case m.state == memberLeased && err != nil:
			b.lose(m)
		case m.state == memberLeased:
			b.mu.Lock()
			m.leased = true
			start := m.onLeased
			b.mu.Unlock()
			if start != nil {
				start()
			}
			b.l.hook("leased", m.id)
		}
	}
}

// lose marks m's lease lost and cancels its handler with ErrLeaseLost.
func (b *fastBatch) lose(m *fastMember) {
	b.mu.Lock()
	m.lost = true
	cancel := m.cancel
	b.mu.Unlock()
	if cancel != nil {
		cancel(ErrLeaseLost)
	}
}

// renewal starts a handler's lease renewals once its lease row exists (at
// once, or when its fast-path batch wrote it) and stops them.
type renewal struct {
	mu    sync.Mutex
	stop  func()
	ended bool
}

// begin starts the renewals with start, unless they ended already.
func (r *renewal) begin(start func() (stop func())) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.ended && r.stop == nil {
		r.stop = start()
	}
}

// end stops the renewals, waiting for one under way.
func (r *renewal) end() {
	r.mu.Lock()
	r.ended = true
	stop := r.stop
	r.mu.Unlock()
	if stop != nil {
		stop()
	}
}
