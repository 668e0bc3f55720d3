// Package idemctx carries the dedup middleware's per-message state (the
// transaction, the event id, the consumer group) in a context.Context, so the
// outbox finds the transaction without importing the middleware.
package idemctx

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Value is what the middleware puts in the handler's context.
type Value struct {
	Tx            pgx.Tx
	EventID       uuid.UUID
	ConsumerGroup string
	// KeyNamespace replaces the group's name in named Idempotency-Keys: the
	// group's recorded namespace, kept across a rename.
	KeyNamespace string
	// CorrelationID is the incoming message's correlation id, if any.
	CorrelationID string
}

// ErrNotInHandler is middleware.ErrNotInHandler: the context does not come
// from a handler wrapped by the dedup middleware.
var ErrNotInHandler = errors.New("watermill-idempotency: not in a dedup handler: the context carries no message transaction or event (is the handler wrapped by the dedup middleware, and does it use msg.Context()?)")

type key struct{}

// With returns ctx carrying v.
func With(ctx context.Context, v *Value) context.Context {
	return context.WithValue(ctx, key{}, v)
}

// From returns the value stored by With, or nil.
func From(ctx context.Context) *Value {
	if ctx == nil {
		return nil
	}
	v, _ := ctx.Value(key{}).(*Value)
	return v
}

// Hooks run functions once the dedup middleware has committed Tx: the
// outbox uses it to wake this process's forwarders when the rows it wrote
// become visible, not before. While the middleware gathers (Gather), they
// also hold the writes to run as one statement per key before the COMMIT
// (group commit: the outbox rows of a whole group in one INSERT per table).
type Hooks struct {
	// Tx is the transaction the hooks wait for.
	Tx pgx.Tx

	mu   sync.Mutex
	keys map[string]func()
	done bool

	gathering bool
	batches   map[string]Batch
	order     []string // the batches' keys, in the order of their first write
	// execs are the statements gathered by Exec, in the order registered.
	execs []exec
}

// exec is one statement gathered by [Hooks.Exec].
type exec struct {
	sql  string
	args []any
}

// Batch is the writes gathered under one key of a [Hooks], queued as one
// statement of the pipeline Flush sends on the hooks' transaction.
type Batch interface {
	// Queue adds the batch's statement to b, with a result function that
	// returns its error as the writer reports it.
	Queue(b *pgx.Batch)
}

// gathering maps a transaction to the Hooks gathering its writes, for the
// writes whose context does not carry them (outbox.Publisher(tx) with
// messages of any context): every write on a gathering transaction must
// join its batch, or a row written at once would come before the rows of
// earlier handlers gathered for the same table.
var gathering sync.Map // pgx.Tx → *Hooks

// Gather makes the writes on h.Tx join batches (BatchFor) until Flush or
// StopGathering. It does nothing when h.Tx cannot be told apart from other
// transactions (a value of an uncomparable type): writes then run at once.
func (h *Hooks) Gather() {
	if !comparableTx(h.Tx) {
		return
	}
	h.mu.Lock()
	h.gathering = true
	h.mu.Unlock()
	gathering.Store(h.Tx, h)
}

// HooksFor returns the hooks of tx: ctx's when they are tx's, else those
// gathering on tx, else nil.
func HooksFor(ctx context.Context, tx pgx.Tx) *Hooks {
	if h := HooksFrom(ctx); h != nil && sameTx(tx, h.Tx) {
		return h
	}
	if !comparableTx(tx) {
		return nil
	}
	if h, ok := gathering.Load(tx); ok {
		return h.(*Hooks)
	}
	return nil
}

// BatchFor returns the batch of key on tx, made by mk on the first call,
// or nil when h is nil, tx is not h.Tx or h is not gathering (the caller
// then writes at once).
func (h *Hooks) BatchFor(tx pgx.Tx, key string, mk func() Batch) Batch {
	if h == nil || !sameTx(tx, h.Tx) {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.gathering {
		return nil
	}
	b, ok := h.batches[key]
	if !ok {
		if h.batches == nil {
			h.batches = map[string]Batch{}
		}
		b = mk()
		h.batches[key] = b
		h.order = append(h.order, key)
	}
	return b
}

// Exec gathers sql with args to run at Flush, before the batches, in the
// order registered, and reports true; it reports false when h is nil or
// not gathering (the caller then runs the statement at once).
func (h *Hooks) Exec(sql string, args []any) bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.gathering {
		return false
	}
	h.execs = append(h.execs, exec{sql: sql, args: args})
	return true
}

// Flush stops gathering and sends the gathered statements (Exec's, then the
// batches', in the order of their first write) on h.Tx in one pipeline: one
// round trip however many there are. The middleware calls it before the
// COMMIT. The first error is returned; PostgreSQL skips the statements
// after it, and the transaction is then aborted.
func (h *Hooks) Flush(ctx context.Context) error {
	h.StopGathering()
	h.mu.Lock()
	bs, order, execs := h.batches, h.order, h.execs
	h.batches, h.order, h.execs = nil, nil, nil
	h.mu.Unlock()
	if len(order) == 0 && len(execs) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	for i, e := range execs {
		b.Queue(e.sql, e.args...).Fn = func(br pgx.BatchResults) error {
			if _, err := br.Exec(); err != nil {
				return fmt.Errorf("gathered statement %d of %d: %w", i+1, len(execs), err)
			}
			return nil
		}
	}
	for _, k := range order {
		bs[k].Queue(b)
	}
	return h.Tx.SendBatch(ctx, b).Close()
}

// StopGathering ends gathering on h (idempotent): later writes run at
// once. The middleware defers it, so a rolled-back transaction leaves no
// entry behind.
func (h *Hooks) StopGathering() {
	h.mu.Lock()
	was := h.gathering
	h.gathering = false
	h.mu.Unlock()
	if was {
		gathering.CompareAndDelete(h.Tx, h)
	}
}

// comparableTx reports whether tx can key a map.
func comparableTx(tx pgx.Tx) bool {
	return tx != nil && reflect.TypeOf(tx).Comparable()
}

type hooksKey struct{}

// WithHooks returns ctx carrying h.
func WithHooks(ctx context.Context, h *Hooks) context.Context {
	return context.WithValue(ctx, hooksKey{}, h)
}

// HooksFrom returns the hooks stored by WithHooks, or nil.
func HooksFrom(ctx context.Context) *Hooks {
	if ctx == nil {
		return nil
	}
	h, _ := ctx.Value(hooksKey{}).(*Hooks)
	return h
}

// OnCommit registers f, once per key, to run after h.Tx commits, and
// reports true; it reports false, registering nothing, when h is nil, tx is
// not h.Tx or h has run already (the caller then acts at once).
func (h *Hooks) OnCommit(tx pgx.Tx, key string, f func()) bool {
	if h == nil || !sameTx(tx, h.Tx) {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return false
	}
	if h.keys == nil {
		h.keys = map[string]func(){}
	}
	h.keys[key] = f
	return true
}

// sameTx reports whether a and b are the same transaction value, without
// the panic of == on a pgx.Tx implementation of an uncomparable type.
func sameTx(a, b pgx.Tx) bool {
	if a == nil || b == nil {
		return false
	}
	ta := reflect.TypeOf(a)
	if ta != reflect.TypeOf(b) || !ta.Comparable() {
		return false
	}
	return a == b
}

// Committed runs the registered functions; the middleware calls it after
// the COMMIT of Tx succeeded.
func (h *Hooks) Committed() {
	h.mu.Lock()
	fs := h.keys
	h.keys, h.done = nil, true
	h.mu.Unlock()
	for _, f := range fs {
		f()
	}
}

// WithHandler returns ctx carrying v (as With) and h (as WithHooks) in one
// context value: the context of every handler the middleware runs, built
// once per message.
func WithHandler(ctx context.Context, v Value, h *Hooks) context.Context {
	return &handlerContext{Context: ctx, v: v, hooks: h}
}

// handlerContext answers From and HooksFrom; every other key, and
// everything else, goes to its parent.
type handlerContext struct {
	context.Context
	v     Value
	hooks *Hooks
}

func (c *handlerContext) Value(k any) any {
	switch k {
	case key{}:
		return &c.v
	case hooksKey{}:
		return c.hooks
	}
	return c.Context.Value(k)
}
