package idemtest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// RequireProcessed fails tb unless eventID has a claim for group in the
// processed_event table described by table (zero value:
// public.processed_event), i.e. the event was applied by that group. The
// primary key makes "once" implicit: there can be at most one row per
// (event, group). db is a pool (committed claims) or the code under test's
// pgx.Tx (the claims it sees, its own uncommitted ones included).
func RequireProcessed(ctx context.Context, tb testing.TB, db migrate.DBTX, table deduplicator.TableConfig, group string, eventID uuid.UUID) {
	tb.Helper()
	if !processed(ctx, tb, db, table, group, eventID) {
		tb.Fatalf("idemtest: event %s was not processed by consumer group %q (no row in the processed_event table)", eventID, group)
	}
}

// RequireNotProcessed fails tb if eventID has a claim for group, as
// [RequireProcessed] sees them.
func RequireNotProcessed(ctx context.Context, tb testing.TB, db migrate.DBTX, table deduplicator.TableConfig, group string, eventID uuid.UUID) {
	tb.Helper()
	if processed(ctx, tb, db, table, group, eventID) {
		tb.Fatalf("idemtest: event %s was processed by consumer group %q, expected it not to be", eventID, group)
	}
}

func processed(ctx context.Context, tb testing.TB, db migrate.DBTX, table deduplicator.TableConfig, group string, eventID uuid.UUID) bool {
	tb.Helper()
	d, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: group}, nil)
	if err != nil {
		tb.Fatalf("idemtest: %v", err)
	}
	_, ok, err := d.ProcessedAt(ctx, db, eventID)
	if err != nil {
		tb.Fatalf("idemtest: %v", err)
	}
	return ok
}

// Default values of [RedeliveryOpts].
const (
	defaultDeliveries  = 4
	defaultConcurrency = 2
)

// RedeliveryOpts tunes [RunWithRedelivery]. A nil *RedeliveryOpts uses the
// defaults.
type RedeliveryOpts struct {
	// Deliveries is how many times the message is delivered in total.
	// Defaults to 4.
	Deliveries int

	// Concurrency is how many deliveries race at the same time; deliveries
	// run in waves of this size (the last one may be smaller). 1 delivers
	// sequentially. Defaults to 2. The dedup middleware's
	// DB must allow that many connections.
	Concurrency int

	// RollbackFirst makes the first run of the handler fail right after it
	// returned successfully, so its transaction rolls back: a crash after the
	// business writes and before COMMIT. The message is then redelivered
	// (one extra delivery). Writes the handler made outside the middleware's
	// transaction survive the rollback and show up as a second effect.
	// Defaults to false.
	RollbackFirst bool

	// TakeOverFirst (lease mode, idem.Config.Mode = &idem.LeaseConfig{}) makes the first run's
	// lease expire while its handler runs, as when its owner stalls past
	// the lease: a second delivery then takes the lease over and completes
	// before the first handler goes on. The first run's completion must
	// then write nothing and return idem.ErrLeaseLost. It needs DB and
	// Table (the dedup middleware's) to expire the lease. Defaults to
	// false.
	TakeOverFirst bool
	// DB and Table reach the lease table for TakeOverFirst.
	DB    migrate.DBTX
	Table deduplicator.TableConfig
}

func (o *RedeliveryOpts) withDefaults() RedeliveryOpts {
	var r RedeliveryOpts
	if o != nil {
		r = *o
	}
	if r.Deliveries <= 0 {
		r.Deliveries = defaultDeliveries
	}
	if r.Concurrency <= 0 {
		r.Concurrency = defaultConcurrency
	}
	return r
}

// RedeliveryResult reports what [RunWithRedelivery] observed.
type RedeliveryResult struct {
	// EventID is the event id the middleware extracted.
	EventID uuid.UUID
	// Deliveries is the number of times the message was delivered,
	// including the redelivery after an injected rollback.
	Deliveries int
	// HandlerRuns counts the handler's invocations (including rolled-back ones).
	HandlerRuns int
	// Committed counts runs whose transaction committed: always 1 when the
	// helper returns.
	Committed int
	// Duplicates counts deliveries the middleware acknowledged without
	// running the handler.
	Duplicates int
	// InjectedRollbacks counts runs rolled back on purpose (RollbackFirst).
	InjectedRollbacks int
	// TakenOver counts runs whose lease was taken over and which wrote
	// nothing (TakeOverFirst).
	TakenOver int
}

// takeOver expires the lease of m's event and delivers a copy of m that
// takes it over and completes, while m's handler has not run yet.
func takeOver(ctx context.Context, tb testing.TB, o RedeliveryOpts, dedup *idem.Dedup, m *message.Message, wrapped message.HandlerFunc) {
	tb.Helper()
	id, _ := idem.EventIDFromContext(m.Context())
	table := o.Table
	if table.Table == "" {
		table.Table = "processed_event"
	}
	if table.Schema == "" {
		table.Schema = "public"
	}
	lease := pgx.Identifier{table.Schema, table.Table + "_lease"}.Sanitize()
	// On the fast path (idem.LeaseConfig.FastPath) the run has no lease row
	// until its batch's FastPath has passed: this run stalls until then, as
	// an owner stalled past its lease would.
	expire := "UPDATE " + lease + " SET expires_at = now() - interval '1 second' WHERE event_id = $1 AND consumer_group = $2"
	var (
		tag pgconn.CommandTag
		err error
	)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		tag, err = o.DB.Exec(ctx, expire, id, dedup.ConsumerGroup())
		if err != nil || tag.RowsAffected() == 1 || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || tag.RowsAffected() != 1 {
		tb.Errorf("idemtest: TakeOverFirst: expire the lease of %s: %v (rows %d; is the middleware in lease mode?)", id, err, tag.RowsAffected())
		return
	}
	c := m.Copy()
	c.SetContext(ctx)
	if _, err := wrapped(c); err != nil {
		tb.Errorf("idemtest: TakeOverFirst: the delivery that took the lease over failed: %v", err)
	}
}

// errInjectedRollback is the error [RunWithRedelivery] returns from the first
// handler run when RedeliveryOpts.RollbackFirst is set.
var errInjectedRollback = errors.New("idemtest: injected failure after the handler returned (transaction rolled back)")

// RunWithRedelivery delivers copies of msg to h wrapped by dedup's middleware
// opts.Deliveries times, in concurrent waves, each copy with ctx as its
// context, and fails tb unless:
//   - every delivery was acknowledged (the middleware returned nil), apart
//     from the injected rollback;
//   - the handler's work committed exactly once, the other deliveries being
//     absorbed as duplicates;
//   - the event is then recorded as processed for dedup's consumer group.
//
// Handler errors fail the test: RunWithRedelivery is for the happy path under
// duplicates. Check your business rows afterwards (exactly one effect).
func RunWithRedelivery(ctx context.Context, tb testing.TB, dedup *idem.Dedup, h message.HandlerFunc, msg *message.Message, opts *RedeliveryOpts) RedeliveryResult {
	tb.Helper()
	o := opts.withDefaults()
	if dedup == nil || h == nil || msg == nil {
		tb.Fatalf("idemtest: RunWithRedelivery needs a dedup middleware, a handler and a message")
	}

	if o.TakeOverFirst && o.DB == nil {
		tb.Fatalf("idemtest: TakeOverFirst needs RedeliveryOpts.DB (and Table) to expire the first run's lease")
	}
	r := &redelivery{ctx: ctx, o: o}
	r.injectOnce.Store(o.RollbackFirst)
	r.takeOverOnce.Store(o.TakeOverFirst)
	r.wrapped = dedup.Middleware(r.counting(tb, dedup, h))

	deliveries := o.Deliveries
	if o.RollbackFirst {
		deliveries++
	}
	if errs := r.deliverInWaves(msg, deliveries); len(errs) > 0 {
		tb.Fatalf("idemtest: %d of %d deliveries failed: %v", len(errs), deliveries, errors.Join(errs...))
	}
	res := RedeliveryResult{
		Deliveries:        deliveries,
		HandlerRuns:       int(r.runs.Load()),
		Committed:         int(r.committed.Load()),
		InjectedRollbacks: int(r.injected.Load()),
		TakenOver:         int(r.takenOver.Load()),
	}
	if o.TakeOverFirst && res.TakenOver != 1 {
		tb.Fatalf("idemtest: TakeOverFirst: the first run's completion was not refused with idem.ErrLeaseLost (is the middleware in lease mode?)")
	}
	res.Deliveries += res.TakenOver // the takeover's own delivery
	res.Duplicates = res.Deliveries - res.HandlerRuns
	if res.Committed != 1 {
		tb.Fatalf("idemtest: the handler committed %d times over %d deliveries, want exactly 1 (runs %d, injected rollbacks %d)",
			res.Committed, res.Deliveries, res.HandlerRuns, res.InjectedRollbacks)
	}
	res.EventID, _ = r.eventID.Load().(uuid.UUID)
	r.deliverOnceMore(tb, msg, res.EventID)
	res.Deliveries++
	res.Duplicates++
	return res
}

// redelivery is one RunWithRedelivery: the wrapped handler and what its
// runs counted.
type redelivery struct {
	ctx                                  context.Context
	o                                    RedeliveryOpts
	wrapped                              message.HandlerFunc
	runs, committed, injected, takenOver atomic.Int64
	eventID                              atomic.Value
	injectOnce, takeOverOnce             atomic.Bool
}

// counting wraps h: it counts runs and commits, injects the first
// rollback, and takes the first run's lease over when asked.
func (r *redelivery) counting(tb testing.TB, dedup *idem.Dedup, h message.HandlerFunc) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		r.runs.Add(1)
		if r.takeOverOnce.CompareAndSwap(true, false) {
			takeOver(r.ctx, tb, r.o, dedup, m, r.wrapped)
		}
		out, err := h(m)
		if err != nil {
			return nil, err
		}
		if r.injectOnce.CompareAndSwap(true, false) {
			r.injected.Add(1)
			return nil, errInjectedRollback
		}
		// Counted inside the committing transaction (at once in transaction
		// mode, by the completion in lease mode, never for a lost lease); a
		// failed COMMIT returns an error below and fails the test anyway.
		if err := idem.Complete(m.Context(), func(context.Context, pgx.Tx) error {
			r.committed.Add(1)
			return nil
		}); err != nil {
			return nil, err
		}
		if id, ok := idem.EventIDFromContext(m.Context()); ok {
			r.eventID.Store(id)
		}
		return out, nil
	}
}

// deliverInWaves delivers copies of msg, Concurrency at a time released
// together, and returns the deliveries' unexpected errors.
func (r *redelivery) deliverInWaves(msg *message.Message, deliveries int) []error {
	var (
		mu   sync.Mutex
		errs []error
	)
	for done := 0; done < deliveries; {
		wave := min(r.o.Concurrency, deliveries-done)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for range wave {
			wg.Go(func() {
				m := msg.Copy()
				m.SetContext(r.ctx)
				<-start
				_, err := r.wrapped(m)
				if r.o.TakeOverFirst && errors.Is(err, idem.ErrLeaseLost) {
					r.takenOver.Add(1)
					err = nil
				}
				if err != nil && !errors.Is(err, errInjectedRollback) {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		close(start)
		wg.Wait()
		done += wave
	}
	return errs
}

// deliverOnceMore proves the claim is committed: one more delivery must be
// skipped.
func (r *redelivery) deliverOnceMore(tb testing.TB, msg *message.Message, id uuid.UUID) {
	tb.Helper()
	m := msg.Copy()
	m.SetContext(r.ctx)
	before := r.runs.Load()
	if _, err := r.wrapped(m); err != nil {
		tb.Fatalf("idemtest: delivery after the commit failed: %v", err)
	}
	if r.runs.Load() != before {
		tb.Fatalf("idemtest: a delivery after the commit ran the handler again: the claim of event %s is not committed", id)
	}
}
