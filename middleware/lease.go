package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// A delivery waiting for another's live lease takes again after
// busyPollFirst, doubling up to busyPollMax (and never past the lease's
// expiry): most leases end with a completion, long before they expire.
const (
	busyPollFirst = 5 * time.Millisecond
	busyPollMax   = time.Second
)

// leaseMode is lease mode ([LeaseConfig]): take, call, complete, with the
// fast path (lease_fast.go) in front of the take.
type leaseMode struct {
	s         *steps
	cfg       LeaseConfig
	db        dbx.Concurrent // Config.DB: concurrent phase transactions and one-round-trip batches
	proto     *leasesql.Protocol
	fast      *fastGate
	takes     *batcher[takeReq]
	completes *batcher[completeReq]
	// hook, set by tests, runs at each phase boundary: "taken" (the lease
	// is committed, or on the fast path its transaction holds the event;
	// the handler not run yet), "called" (the handler returned nil, the
	// completion not sent), "completing" (inside the completion's
	// transaction, or the fast path's: claim inserted, not committed; a
	// pipelined completion, whose check and commit travel together: just
	// before it is sent),
	// "leased" (a fast-path handler still running at FastPath got its
	// lease row, committed), "busy" (a take found another delivery's
	// lease or fast-path transaction, and waits), "renewed" (a renewal
	// succeeded).
	hook func(point string, id uuid.UUID)
}

func newLeaseMode(s *steps, cfg LeaseConfig, db dbx.Concurrent) *leaseMode {
	// The protocol on the claim table comes from its owner, deduplicator.
	l := &leaseMode{s: s, cfg: cfg, db: db, proto: leasesql.Of(s.claims), fast: newFastGate(), hook: func(string, uuid.UUID) {}}
	l.takes = newBatcher(cfg.MaxBatch, cfg.Concurrency, l.runTakes)
	l.completes = newBatcher(cfg.MaxBatch, cfg.Concurrency, l.runCompletes)
	return l
}

type takeReq struct {
	ctx    context.Context
	req    leasesql.Request
	res    leasesql.Take
	member *fastMember // an owned event on the fast path: no lease row yet
	err    error
	done   chan struct{}
}

type completeReq struct {
	origCtx  context.Context
	msg      *message.Message
	id       uuid.UUID
	token    uuid.UUID
	writes   []write
	produced []*message.Message

	result leasesql.Result
	out    []*message.Message
	err    error
	done   chan struct{}
}

// process runs msg in lease mode: take, call, complete.
func (l *leaseMode) process(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) (produced []*message.Message, outcome string, err error) {
	s := l.s
	origCtx := msg.Context()
	defer msg.SetContext(origCtx)
	fields := watermill.LogFields{"event_id": id.String(), "message_uuid": msg.UUID}
	token := uuid.New()

	owned, member, outcome, err := l.takeOne(origCtx, id, token, span, fields)
	if !owned {
		return nil, outcome, err
	}

	// The call: no transaction, no connection of its own.
	hctx, cancel := context.WithCancelCause(origCtx)
	defer cancel(nil)
	state := &leaseState{}
	v := s.handlerValue(nil, msg, id)
	hctx = withLeaseState(idemctx.With(hctx, &v), state)
	ren := &renewal{}
	startRenewing := func() { ren.begin(func() func() { return l.renewWhileCalling(id, token, cancel) }) }
	if member == nil {
		startRenewing()
	} else {
		member.attach(startRenewing, cancel)
	}
	completed, reported := false, false
	defer func() {
		if member != nil && !reported {
			member.report(nil) // a panic: the batch must not wait for it, nor lease it
		}
		ren.end()
		if !completed { // a handler error or panic, a failed completion
			l.release(origCtx, id, token, fields)
		}
	}()
	msg.SetContext(hctx)
	callStart := time.Now()
	produced, err = h(msg)
	if member == nil && l.cfg.FastPath > 0 {
		// A lease-row call tells the fast path's gate how long handlers take.
		done := 0
		if time.Since(callStart) <= l.cfg.FastPath {
			done = 1
		}
		l.fast.record(done, 1)
	}
	var c *completeReq
	if err == nil {
		l.hook("called", id)
		c = &completeReq{origCtx: origCtx, msg: msg, id: id, token: token, writes: state.writes(), produced: produced, done: make(chan struct{})}
	}
	reportedAt := time.Now()
	reported = true
	if member != nil && member.report(c) {
		// Settled on the fast path: completed in its take's transaction,
		// or failed there; no lease row was written either way.
		completed = true
		if err != nil {
			s.stats.failed.Add(1)
			return nil, outcomeFailed, err
		}
		l.phaseSpan(span, origCtx, "complete", trace.WithTimestamp(reportedAt))(c.err, attribute.Bool("idem.lease.fast_path", true))
		return l.settle(c, fields, true)
	}
	ren.end()
	if err != nil {
		s.stats.failed.Add(1)
		return nil, outcomeFailed, err
	}
	if errors.Is(context.Cause(hctx), ErrLeaseLost) {
		completed = true // not ours to release
		s.stats.leasesLost.Add(1)
		return nil, outcomeLeaseLost, fmt.Errorf("dedup: event %s: %w (renewal found it taken over while the handler ran)", id, ErrLeaseLost)
	}
	produced, outcome, err = l.complete(c, span)
	// Only a failed completion leaves the lease to release.
	completed = outcome != outcomeFailed
	return produced, outcome, err
}

// takeOne takes id's lease with token; owned is false when the event is
// done (a duplicate), busy or the take failed, with that outcome and error.
// m is the event's place in a fast-path transaction, nil when it has its
// lease row.
func (l *leaseMode) takeOne(ctx context.Context, id, token uuid.UUID, span *msgSpan, fields watermill.LogFields) (owned bool, m *fastMember, outcome string, err error) {
	s := l.s
	start := time.Now()
	lt, m, err := l.take(ctx, id, token, span)
	s.stats.claimed(time.Since(start))
	if err != nil {
		s.stats.claimErrors.Add(1)
		return false, nil, outcomeClaimError, fmt.Errorf("dedup: %w", err)
	}
	switch lt.State {
	case leasesql.Done:
		s.stats.duplicates.Add(1)
		s.logger.Debug("Duplicate event skipped", fields)
		return false, nil, outcomeDuplicate, nil
	case leasesql.Busy:
		s.stats.leasesBusy.Add(1)
		return false, nil, outcomeLeaseBusy, fmt.Errorf("dedup: event %s: %w (it lives for up to %s more)", id, ErrLeaseBusy, lt.Remaining.Round(time.Millisecond))
	}
	s.stats.leasesTaken.Add(1)
	if lt.TakenOver {
		s.stats.leasesTakenOver.Add(1)
		s.logger.Info("Expired lease taken over", fields.Add(watermill.LogFields{"attempts": lt.Attempts}))
	}
	l.hook("taken", id)
	return true, m, "", nil
}

// complete runs c (the claim, the writes and the messages produced, in one
// transaction, with others) and returns what the message's handling gives.
func (l *leaseMode) complete(c *completeReq, span *msgSpan) ([]*message.Message, string, error) {
	end := l.phaseSpan(span, c.origCtx, "complete")
	cstart := time.Now()
	l.completes.do(c, c.done)
	end(c.err)
	if c.err == nil && c.result == leasesql.Completed {
		l.s.stats.txNanos.Add(uint64(time.Since(cstart)))
	}
	return l.settle(c, watermill.LogFields{"event_id": c.id.String(), "message_uuid": c.msg.UUID}, false)
}

// settle turns c's completion into the message's outcome; fast says it
// completed on the fast path.
func (l *leaseMode) settle(c *completeReq, fields watermill.LogFields, fast bool) ([]*message.Message, string, error) {
	s := l.s
	switch {
	case c.err != nil:
		s.stats.failed.Add(1)
		return nil, outcomeFailed, c.err
	case c.result == leasesql.Lost:
		s.stats.leasesLost.Add(1)
		s.logger.Info("Lease lost before completion: nothing written", fields)
		return nil, outcomeLeaseLost, fmt.Errorf("dedup: event %s: %w (it expired and another delivery took it over, or an operator released it); nothing was written", c.id, ErrLeaseLost)
	case c.result == leasesql.Duplicate:
		s.stats.duplicates.Add(1)
		return nil, outcomeDuplicate, nil
	}
	s.stats.processed.Add(1)
	if fast {
		s.stats.leasesFastPath.Add(1)
	}
	s.logger.Trace("Event processed", fields)
	return c.out, outcomeProcessed, nil
}

// take takes the lease of id with token, waiting up to BusyWait while
// another delivery holds it.
func (l *leaseMode) take(ctx context.Context, id, token uuid.UUID, span *msgSpan) (leasesql.Take, *fastMember, error) {
	end := l.phaseSpan(span, ctx, "lease")
	deadline := time.Now().Add(l.cfg.BusyWait)
	step := busyPollFirst
	for {
		t := &takeReq{ctx: ctx, req: leasesql.Request{EventID: id, Token: token}, done: make(chan struct{})}
		l.takes.do(t, t.done)
		left := time.Until(deadline)
		if t.err != nil || t.res.State != leasesql.Busy || left <= 0 {
			end(t.err, attribute.String("idem.lease", t.res.State.String()), attribute.Bool("idem.lease.taken_over", t.res.TakenOver),
				attribute.Bool("idem.lease.fast_path", t.member != nil))
			return t.res, t.member, t.err
		}
		// Remaining is 0 when unknown (a fast-path transaction holds the
		// event): poll.
		pause := min(left, step)
		if t.res.Remaining > 0 {
			pause = min(pause, t.res.Remaining)
		}
		l.hook("busy", id)
		step = min(2*step, busyPollMax)
		if err := wait.Sleep(ctx, pause); err != nil {
			end(err)
			return leasesql.Take{}, nil, err
		}
	}
}

func (l *leaseMode) runTakes(batch []*takeReq, release func()) {
	if l.cfg.FastPath > 0 && l.fast.open() {
		l.openFast(batch, release)
		return
	}
	defer release()
	defer func() {
		for _, t := range batch {
			close(t.done)
		}
	}()
	// Bounded by a lease: a take that has not answered by then (a server
	// gone without a TCP reset) would hand out leases already expired.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(batch[0].ctx), l.cfg.Duration)
	defer cancel()
	res, err := l.proto.Take(ctx, l.db, takeRequests(batch), l.cfg.Duration, l.cfg.Owner)
	for i, t := range batch {
		if err != nil {
			t.err = fmt.Errorf("take lease: %w", err)
			continue
		}
		t.res = res[i]
	}
}

// takeRequests returns the requests of batch.
func takeRequests(batch []*takeReq) []leasesql.Request {
	reqs := make([]leasesql.Request, len(batch))
	for i, t := range batch {
		reqs[i] = t.req
	}
	return reqs
}

// renewWhileCalling renews the lease every RenewInterval until stop is
// called; a renewal that finds the lease gone cancels the handler's
// context with ErrLeaseLost. It costs a timer, no goroutine, until the
// first renewal is due: most calls end long before.
func (l *leaseMode) renewWhileCalling(id, token uuid.UUID, cancel context.CancelCauseFunc) (stop func()) {
	var (
		mu      sync.Mutex
		stopped bool
		t       *time.Timer
		running sync.WaitGroup
	)
	tick := func() {
		mu.Lock()
		if stopped {
			mu.Unlock()
			return
		}
		running.Add(1)
		mu.Unlock()
		defer running.Done()
		ctx, done := context.WithTimeout(context.Background(), l.cfg.RenewInterval)
		ok, err := l.proto.Renew(ctx, l.db, id, token, l.cfg.Duration)
		done()
		switch {
		case err != nil: // the next tick tries again; the completion tells
			l.s.logger.Error("Lease renewal failed", err, watermill.LogFields{"event_id": id.String()})
		case !ok:
			cancel(ErrLeaseLost)
			return
		default:
			l.s.stats.leasesRenewed.Add(1)
			l.hook("renewed", id)
		}
		mu.Lock()
		if !stopped {
			t.Reset(l.cfg.RenewInterval)
		}
		mu.Unlock()
	}
	mu.Lock()
	t = time.AfterFunc(l.cfg.RenewInterval, tick)
	mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			mu.Lock()
			stopped = true
			t.Stop()
			mu.Unlock()
			running.Wait() // a renewal under way ends before the completion
		})
	}
}

// release deletes the lease after a failure, so the redelivery takes a new
// one at once instead of waiting for it to expire.
func (l *leaseMode) release(ctx context.Context, id, token uuid.UUID, fields watermill.LogFields) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.Duration)
	defer cancel()
	if _, err := l.proto.Release(ctx, l.db, id, token); err != nil {
		l.s.logger.Error("Lease release failed: the event waits for the lease to expire", err, fields)
	}
}

// errMemberFailed makes a batch of completions fall back to one
// transaction each: one member's writes failed, and the others must not
// pay for it.
var errMemberFailed = errors.New("a completion of the batch failed")

func (l *leaseMode) runCompletes(batch []*completeReq, release func()) {
	defer release()
	defer func() {
		for _, c := range batch {
			close(c.done)
		}
	}()
	if err := l.completeBatch(batch); errors.Is(err, errMemberFailed) {
		l.s.stats.groupFallbacks.Add(1)
		for _, c := range batch {
			c.result, c.out, c.err = 0, nil, nil
			_ = l.completeBatch([]*completeReq{c})
		}
	}
}

// completeBatch completes the batch in one transaction. A member whose
// writes fail rolls it back: alone, that member gets the error; in a batch
// of several, completeBatch returns errMemberFailed and sets nothing.
func (l *leaseMode) completeBatch(batch []*completeReq) (err error) {
	// Bounded by a lease, like the take: past it the tokens may be taken
	// over anyway, and a server gone without a TCP reset must not hold the
	// batch's messages for good. A cut COMMIT is an unknown outcome: the
	// messages are nacked and the redelivery's take tells.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(batch[0].origCtx), l.cfg.Duration)
	defer cancel()
	ids := make([]uuid.UUID, len(batch))
	toks := make([]uuid.UUID, len(batch))
	for i, c := range batch {
		ids[i], toks[i] = c.id, c.token
	}
	if l.pipelined(batch) {
		err := l.completePipelined(ctx, batch, ids, toks)
		if !errors.Is(err, leasesql.ErrNotAllHeld) && !errors.Is(err, errPipelineRefused) {
			return err
		}
		// A token was lost, or an event claimed by another mode, or a
		// statement refused: nothing was written; the transaction below
		// tells which member it was, and sends the statements one by one
		// (rare: a lease expired, an operator's release, a bad statement).
	}
	tx, res, err := l.proto.BeginComplete(ctx, l.db, ids, toks)
	committed := false
	defer func() {
		if !committed && tx != nil {
			_ = tx.Rollback(ctx)
		}
	}()
	if err != nil {
		return l.failAll(batch, fmt.Errorf("dedup: %w", err))
	}
	// The batch's outbox rows go in one INSERT per table before the COMMIT.
	hooks := &idemctx.Hooks{Tx: tx}
	hooks.Gather()
	defer hooks.StopGathering()
	for i, c := range batch {
		c.result = res[i]
		if res[i] != leasesql.Completed {
			continue
		}
		if werr := l.write(c, tx, hooks); werr != nil {
			if len(batch) > 1 {
				for _, c := range batch {
					c.result, c.out = 0, nil
				}
				return errMemberFailed
			}
			c.err = werr
			return werr
		}
	}
	if err := hooks.Flush(ctx); err != nil {
		if len(batch) > 1 {
			for _, c := range batch {
				c.result, c.out = 0, nil
			}
			return errMemberFailed
		}
		return l.failAll(batch, fmt.Errorf("dedup: write the outbox rows: %w", err))
	}
	for _, id := range ids {
		l.hook("completing", id)
	}
	if err := tx.Commit(ctx); err != nil {
		// The outcome is unknown: the redelivery's take tells (done, or the
		// lease, released by process, taken anew).
		return l.failAll(batch, fmt.Errorf("dedup: complete: commit: %w", err))
	}
	committed = true
	hooks.Committed()
	return nil
}

// pipelined reports whether every member of batch can complete in one
// pipeline: its writes are all [CompleteExec] statements and it has no
// messages for the outbox (whose writes need the transaction).
func (l *leaseMode) pipelined(batch []*completeReq) bool {
	for _, c := range batch {
		if len(c.produced) > 0 && l.s.outbox != nil {
			return false
		}
		for _, w := range c.writes {
			if w.fn != nil {
				return false
			}
		}
	}
	return true
}

// completePipelined completes batch in one round trip: the tokens'
// check and the claims, then every member's statements, sent as one batch
// that PostgreSQL runs as one implicit transaction. The check fails the
// transaction unless every token holds its lease (returning
// [leasesql.ErrNotAllHeld], nothing set); a failing statement fails it
// too, and then, as in completeBatch, a lone member gets the error and a
// batch of several returns errMemberFailed. The check's DELETE locks the
// leases until the commit, at the end of the same batch: no takeover can
// come between them.
func (l *leaseMode) completePipelined(ctx context.Context, batch []*completeReq, ids, toks []uuid.UUID) error {
	b := &pgx.Batch{}
	l.proto.QueueCompleteAll(b, ids, toks)
	for _, c := range batch {
		for _, w := range c.writes {
			b.Queue(w.sql, w.args...)
		}
	}
	stmts := b.Len() - 1
	for _, id := range ids {
		l.hook("completing", id)
	}
	br := l.db.SendBatch(ctx, b)
	defer br.Close()
	if err := leasesql.ReadCompleteAll(br); err != nil {
		if errors.Is(err, leasesql.ErrNotAllHeld) {
			return err
		}
		if refused(err, stmts) {
			return errPipelineRefused
		}
		return l.failAll(batch, fmt.Errorf("dedup: %w", err))
	}
	for _, c := range batch {
		for i := range c.writes {
			if _, err := br.Exec(); err != nil {
				if len(batch) > 1 {
					return errMemberFailed
				}
				c.err = fmt.Errorf("dedup: idem.CompleteExec statement %d of event %s: %w", i+1, c.id, err)
				return c.err
			}
		}
	}
	if err := br.Close(); err != nil {
		// The commit's outcome is unknown, as in completeBatch.
		return l.failAll(batch, fmt.Errorf("dedup: complete: commit: %w", err))
	}
	for _, c := range batch {
		c.result = leasesql.Completed
		// Without an outbox the messages go to the router: no write.
		c.out, _ = l.s.toOutbox(c.origCtx, c.origCtx, nil, c.produced)
	}
	return nil
}

// errPipelineRefused: PostgreSQL refused a pipelined completion at its
// first statement. pgx prepares a batch's new statements together before
// running any, so a member's statement that does not prepare (a missing
// table, a syntax error) fails there, as the library's own would:
// completing without the pipeline tells whose it was.
var errPipelineRefused = errors.New("the pipelined completion was refused")

// refused reports whether err, the first result of a pipelined
// completion that holds stmts statements of handlers, may be one of
// them refused: PostgreSQL's error for a statement (severity ERROR), not
// a session ended (FATAL: the server's shutdown, a terminated backend) nor
// a lost connection.
func refused(err error, stmts int) bool {
	var pgErr *pgconn.PgError
	return stmts > 0 && errors.As(err, &pgErr) && pgErr.Severity == "ERROR"
}

// failAll sets err on every member of batch and returns it.
func (l *leaseMode) failAll(batch []*completeReq, err error) error {
	for _, c := range batch {
		c.err = err
	}
	return err
}

// write runs c's registered writes and its returned messages' outbox
// writes in tx. A panic in a write is returned as an error: the batch's
// other members are not to be taken down with it.
func (l *leaseMode) write(c *completeReq, tx pgx.Tx, hooks *idemctx.Hooks) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("dedup: a Complete function panicked: %v", p)
		}
	}()
	wctx := l.s.handlerContext(c.origCtx, tx, hooks, c.msg, c.id)
	for i, w := range c.writes {
		if w.fn != nil {
			if err := w.fn(wctx, tx); err != nil {
				return err
			}
			continue
		}
		if _, err := tx.Exec(wctx, w.sql, w.args...); err != nil {
			return fmt.Errorf("dedup: idem.CompleteExec statement %d of event %s: %w", i+1, c.id, err)
		}
	}
	if err := txUsable(tx); err != nil {
		return err
	}
	c.out, err = l.s.toOutbox(wctx, c.origCtx, tx, c.produced)
	return err
}

// phaseSpan starts a child span of the message's span for one phase and
// returns its end; a no-op without a message span.
func (l *leaseMode) phaseSpan(span *msgSpan, ctx context.Context, name string, opts ...trace.SpanStartOption) func(err error, attrs ...attribute.KeyValue) {
	if span == nil {
		return func(error, ...attribute.KeyValue) {}
	}
	tr := l.s.tracer.Tracer()
	if tr == nil {
		return func(error, ...attribute.KeyValue) {}
	}
	_, s := tr.Start(trace.ContextWithSpan(ctx, span.span), name, append(opts, trace.WithSpanKind(trace.SpanKindInternal))...)
	return func(err error, attrs ...attribute.KeyValue) {
		s.SetAttributes(attrs...)
		if err != nil {
			s.RecordError(err)
			s.SetStatus(codes.Error, err.Error())
		}
		s.End()
	}
}
