package middleware

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// groupMode is group commit: it gathers concurrent messages into groups.
// There is no background goroutine: the first message of a group leads it
// (waits for a slot and for others to join, then runs it), the others wait
// for their result. A message goes alone, in transaction mode, after its
// handler failed once, or when its group's claim failed.
type groupMode struct {
	s     *steps
	alone *txMode
	cfg   GroupCommitConfig
	slots chan struct{}

	mu       sync.Mutex
	open     *group // gathering, nil when none
	inflight int    // messages submitted and not answered yet

	// failed holds the ids whose handler failed once: they are processed
	// alone from then on.
	failed failedSet
}

type group struct {
	reqs   []*request
	joined chan struct{} // a request joined (buffered 1)
	full   chan struct{} // closed when the group is full
}

type request struct {
	msg  *message.Message
	h    message.HandlerFunc
	id   uuid.UUID
	span *msgSpan
	done chan result // buffered 1: send through reply
	out  []*message.Message
	// answered is set by reply; only the group's leader touches it.
	answered bool
}

// reply hands r its result (once).
func (r *request) reply(res result) {
	r.answered = true
	r.done <- res
}

// result is a message's outcome; alone means: process it in its own
// transaction instead; panicked holds the value its handler panicked with
// (the group was rolled back), to raise again in the message's own
// goroutine.
type result struct {
	produced []*message.Message
	outcome  string
	err      error
	alone    bool
	panicked any
}

func newGroupMode(s *steps, cfg GroupCommitConfig) *groupMode {
	gc := &groupMode{s: s, cfg: cfg, slots: make(chan struct{}, cfg.Concurrency), failed: newFailedSet(4096)}
	gc.alone = &txMode{s: s, handlerFailed: gc.failed.add}
	return gc
}

// process runs msg in a group, or alone: after an earlier failure of its
// handler, or when the group could not claim. A handler that panicked in
// the group panics again here, in its message's goroutine, as it does in
// transaction mode; it is not run a second time.
func (gc *groupMode) process(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) ([]*message.Message, string, error) {
	if !gc.failed.has(id) {
		res := gc.submit(msg, h, id, span)
		if res.panicked != nil {
			gc.s.stats.failed.Add(1)
			panic(res.panicked)
		}
		if !res.alone {
			return res.produced, res.outcome, res.err
		}
	}
	gc.s.stats.alone.Add(1)
	return gc.alone.process(msg, h, id, span)
}

// submit adds the message to the open group (opening one, and leading it,
// when there is none) and waits for its result.
func (gc *groupMode) submit(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) result {
	r := &request{msg: msg, h: h, id: id, span: span, done: make(chan result, 1)}
	gc.mu.Lock()
	g := gc.open
	leader := g == nil
	if leader {
		g = &group{joined: make(chan struct{}, 1), full: make(chan struct{})}
		gc.open = g
	}
	g.reqs = append(g.reqs, r)
	gc.inflight++
	// Only messages in flight can join: with one message per partition in
	// flight, n partitions fill Concurrency groups of n/Concurrency, and a
	// lone message runs at once instead of waiting for company.
	if len(g.reqs) >= gc.want() {
		gc.open = nil
		close(g.full)
	} else if !leader {
		select {
		case g.joined <- struct{}{}:
		default:
		}
	}
	gc.mu.Unlock()
	if leader {
		gc.lead(g)
	}
	res := <-r.done
	gc.mu.Lock()
	gc.inflight--
	// Fewer in flight: the open group may already hold its share.
	if g := gc.open; g != nil && len(g.reqs) >= gc.want() {
		gc.open = nil
		close(g.full)
	}
	gc.mu.Unlock()
	return res
}

// want is the size at which the open group seals: its share of the
// messages in flight, at most MaxMessages. Called with mu held.
func (gc *groupMode) want() int {
	return min(gc.cfg.MaxMessages, (gc.inflight+gc.cfg.Concurrency-1)/gc.cfg.Concurrency)
}

// lead waits for a slot and for the group to gather, seals it and runs it.
func (gc *groupMode) lead(g *group) {
	deadline := time.NewTimer(gc.cfg.MaxWait)
	defer deadline.Stop()
	gc.slots <- struct{}{} // while all slots are busy, the group keeps gathering
	defer func() { <-gc.slots }()
	idleGap := gc.cfg.MaxWait / 5
	idle := time.NewTimer(idleGap)
	defer idle.Stop()
gather:
	for {
		select {
		case <-g.full:
			break gather
		case <-deadline.C:
			break gather
		case <-idle.C:
			break gather
		case <-g.joined:
			idle.Reset(idleGap)
		}
	}
	gc.mu.Lock()
	if gc.open == g {
		gc.open = nil
	}
	reqs := g.reqs // sealed: nobody appends any more
	gc.mu.Unlock()
	// A panic outside the handlers (handle recovers theirs) must not leave
	// the group's other messages waiting for an answer for good, in
	// goroutines that hold no transaction: each unanswered one fails (it
	// is nacked and redelivered), and the panic goes on in the leader's
	// goroutine, as it would without a group.
	defer func() {
		if p := recover(); p != nil {
			err := fmt.Errorf("dedup: group commit panicked: %v", p)
			for _, r := range reqs {
				if !r.answered {
					r.reply(result{outcome: outcomeFailed, err: err})
				}
			}
			panic(p)
		}
	}()
	gc.run(reqs)
}

// run processes a sealed group in one transaction and hands every request
// its result. When a handler fails (an error, a panic, or a transaction it
// left unusable), that message (the culprit) and its copies go alone, and
// the rest of the group runs again as a group, in a new transaction: each
// round removes at least one message, so it ends.
func (gc *groupMode) run(reqs []*request) {
	for len(reqs) > 0 {
		reqs = gc.runOnce(reqs)
	}
}

// runOnce processes reqs in one transaction and hands each its result, or
// returns the requests to run again as a group (none answered yet) after a
// handler failure rolled the group back.
func (gc *groupMode) runOnce(reqs []*request) (again []*request) {
	s := gc.s
	// Database work outlives any single message's cancellation: a group is
	// committed or rolled back as a whole.
	ctx := context.WithoutCancel(reqs[0].msg.Context())
	ids := make([]uuid.UUID, len(reqs))
	for i, r := range reqs {
		ids[i] = r.id
	}
	gspan := gc.startSpan(reqs)
	defer gspan.End()
	start := time.Now()
	var tx pgx.Tx
	defer func() {
		if p := recover(); p != nil {
			if tx != nil {
				s.rollback(ctx, tx, nil) // closed already: ignored
			}
			panic(p)
		}
	}()
	msgs := make([]*message.Message, len(reqs))
	for i, r := range reqs {
		msgs[i] = r.msg
	}
	tx, first, err := s.claims.BeginClaimBatch(s.progress.progressContext(ctx, msgs...), s.db, s.txOpts, ids)
	s.stats.claimed(time.Since(start))
	if err != nil {
		// Each message retries its own claim, alone, and reports its own error.
		if tx != nil {
			s.rollback(ctx, tx, nil)
		}
		s.logger.Info("Group claim failed, processing its messages alone", watermill.LogFields{"messages": len(reqs), "error": err.Error()})
		gspan.RecordError(err)
		gc.answer(reqs, result{alone: true})
		return nil
	}
	s.stats.groups.Add(1)
	s.stats.grouped.Add(uint64(len(reqs)))

	g := &claimedGroup{ctx: ctx, tx: tx, span: gspan, start: start}
	gc.sortClaimed(g, reqs, first)
	// The outbox rows of the whole group are gathered, one INSERT per
	// table before the COMMIT, in the order the handlers wrote them.
	hooks := &idemctx.Hooks{Tx: tx}
	hooks.Gather()
	defer hooks.StopGathering()
	for _, r := range g.runs {
		if err := gc.handle(tx, hooks, r); err != nil {
			return gc.failOne(g, r, err)
		}
	}
	gc.commit(g, hooks)
	return nil
}

// claimedGroup is a group whose claims are taken in tx: runs are the
// requests that run, copies those that share the outcome of a run of the
// same id.
type claimedGroup struct {
	ctx          context.Context
	tx           pgx.Tx
	span         trace.Span
	start        time.Time
	runs, copies []*request
}

// sortClaimed sorts reqs into g: the first request of a newly claimed id
// (in first) runs; a copy of it in the same group shares its outcome; a
// request whose claim already existed is a duplicate, acked at once.
func (gc *groupMode) sortClaimed(g *claimedGroup, reqs []*request, first []uuid.UUID) {
	firstOf := map[uuid.UUID]bool{}
	for _, id := range first {
		firstOf[id] = true
	}
	wait := time.Since(g.start)
	for _, r := range reqs {
		r.span.claimed(wait, firstOf[r.id])
		switch {
		case !firstOf[r.id]:
			gc.s.stats.duplicates.Add(1)
			r.reply(result{outcome: outcomeDuplicate})
		case slices.ContainsFunc(g.runs, func(o *request) bool { return o.id == r.id }):
			g.copies = append(g.copies, r)
		default:
			g.runs = append(g.runs, r)
		}
	}
}

// failOne rolls g back after r's handler failed: r is the culprit. After
// an error it goes alone (and stays alone on its later attempts); after a
// panic it panics again in its own goroutine (gc.process). The others,
// whose work is rolled back with it, are returned to run again as a group.
func (gc *groupMode) failOne(g *claimedGroup, r *request, err error) (again []*request) {
	s := gc.s
	s.rollback(g.ctx, g.tx, nil)
	gc.failed.add(r.id)
	s.stats.groupFallbacks.Add(1)
	g.span.AddEvent("rollback: a handler failed; it is processed alone, the others again as a group")
	s.logger.Debug("Handler failed in a group: rolling the group back; it is processed alone, the others again as a group", watermill.LogFields{
		"event_id": r.id.String(), "messages": len(g.runs) + len(g.copies), "error": err.Error(),
	})
	culprit := result{alone: true}
	var p *handlerPanic
	if errors.As(err, &p) {
		culprit = result{panicked: p.value}
	}
	for _, o := range append(g.runs, g.copies...) {
		if o.id == r.id {
			o.reply(culprit)
		} else {
			again = append(again, o)
		}
	}
	return again
}

// handlerPanic is a handler's panic recovered in a group, so the group can
// be rolled back before it is raised again in the message's goroutine.
type handlerPanic struct {
	value any
}

func (p *handlerPanic) Error() string {
	return fmt.Sprintf("dedup: handler panicked in a group: %v", p.value)
}

// commit writes the group's gathered writes in one pipeline (its handlers'
// CompleteExec statements, then one INSERT of outbox rows per table:
// idemctx.Hooks.Flush), commits g and answers each request. When they
// cannot be written, each message goes alone, where its own write reports
// its own error.
func (gc *groupMode) commit(g *claimedGroup, hooks *idemctx.Hooks) {
	s := gc.s
	if err := hooks.Flush(g.ctx); err != nil {
		s.rollback(g.ctx, g.tx, nil)
		s.stats.groupFallbacks.Add(1)
		g.span.RecordError(err)
		s.logger.Info("Group's gathered writes (CompleteExec statements, outbox rows) failed, processing its messages alone", watermill.LogFields{"messages": len(g.runs), "error": err.Error()})
		gc.answer(g.runs, result{alone: true})
		gc.answer(g.copies, result{alone: true})
		return
	}
	g.span.AddEvent("commit")
	if err := g.tx.Commit(g.ctx); err != nil {
		// The outcome is unknown: nack them all; the redeliveries' claims
		// tell which way it went.
		s.stats.failed.Add(uint64(len(g.runs)))
		err = fmt.Errorf("dedup: group commit of %d messages: %w", len(g.runs), err)
		g.span.RecordError(err)
		gc.answer(g.runs, result{outcome: outcomeFailed, err: err})
		gc.answer(g.copies, result{outcome: outcomeFailed, err: err})
		return
	}
	hooks.Committed()
	s.stats.processed.Add(uint64(len(g.runs)))
	s.stats.duplicates.Add(uint64(len(g.copies)))
	s.stats.txNanos.Add(uint64(time.Since(g.start)) * uint64(len(g.runs)))
	for _, r := range g.runs {
		r.reply(result{produced: r.out, outcome: outcomeProcessed})
	}
	gc.answer(g.copies, result{outcome: outcomeDuplicate})
}

// startSpan begins the group's span, linked to its messages' spans (a group
// has many parents). It is a no-op span when tracing is off.
func (gc *groupMode) startSpan(reqs []*request) trace.Span {
	tr := gc.s.tracer.Tracer()
	if tr == nil {
		return noop.Span{}
	}
	links := make([]trace.Link, 0, len(reqs))
	for _, r := range reqs {
		if r.span != nil {
			links = append(links, trace.Link{SpanContext: r.span.span.SpanContext()})
		}
	}
	_, span := tr.Start(context.Background(), "group commit", trace.WithLinks(links...), trace.WithAttributes(
		semconv.MessagingConsumerGroupName(gc.s.group), otelx.AttrGroupSize.Int(len(reqs)),
	))
	return span
}

func (gc *groupMode) answer(reqs []*request, res result) {
	for _, r := range reqs {
		r.reply(res)
	}
}

// handle runs r's handler on the group's transaction, with r's own message
// context (restored afterwards) less its cancellation: the statements of
// every handler of the group run on one connection, where a cancelled
// statement would end the session and the whole group with it (a message
// cancelled by a rebalance must not fail the others). Messages it returns
// go to the outbox as in transaction mode (stamped in that context), where
// they join the group's gathered rows after the handler's own writes; or
// are kept for the router without an outbox. A panic is returned as a
// *handlerPanic: the group is rolled back first, then the message panics in
// its own goroutine. A handler that returns nil but leaves the transaction
// unusable (it swallowed an SQL error, so PostgreSQL refuses every later
// statement) fails with ErrTxAborted: it is the culprit, not the next
// handler, whose statements would fail.
func (gc *groupMode) handle(tx pgx.Tx, hooks *idemctx.Hooks, r *request) (err error) {
	s := gc.s
	origCtx := r.msg.Context()
	defer r.msg.SetContext(origCtx)
	defer func() {
		if p := recover(); p != nil {
			s.logger.Error("Handler panicked in a group", fmt.Errorf("%v", p), watermill.LogFields{"event_id": r.id.String(), "stack": string(debug.Stack())})
			err = &handlerPanic{value: p}
		}
	}()
	r.msg.SetContext(s.handlerContext(context.WithoutCancel(origCtx), tx, hooks, r.msg, r.id))
	produced, err := r.h(r.msg)
	if err != nil {
		return err
	}
	if err := txUsable(tx); err != nil {
		return err
	}
	r.out, err = s.toOutbox(r.msg.Context(), origCtx, tx, produced)
	return err
}

// failedSet remembers up to about 2×max ids (two generations).
type failedSet struct {
	mu        sync.Mutex
	max       int
	cur, prev map[uuid.UUID]struct{}
}

func newFailedSet(max int) failedSet {
	return failedSet{max: max, cur: map[uuid.UUID]struct{}{}}
}

func (s *failedSet) add(id uuid.UUID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur[id] = struct{}{}
	if len(s.cur) >= s.max {
		s.prev, s.cur = s.cur, map[uuid.UUID]struct{}{}
	}
}

func (s *failedSet) has(id uuid.UUID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.cur[id]
	if !ok {
		_, ok = s.prev[id]
	}
	return ok
}
