// Package idemctx carries the dedup middleware's per-message state (the
// transaction, the event id, the consumer group) in a context.Context, so the
// outbox finds the transaction without importing the middleware.
package idemctx

import (
	"context"
	"errors"
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
// become visible, not before.
type Hooks struct {
	// Tx is the transaction the hooks wait for.
	Tx pgx.Tx

	mu   sync.Mutex
	keys map[string]func()
	done bool
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

type stampedKey struct{}

// WithStamped returns ctx marking the messages written with it as stamped
// already: group commit stamps each handler's messages in that handler's
// context, then writes the group's messages together, and the outbox need
// not stamp them again (Stamp would change nothing). Only the middleware's
// own write carries it, never a handler's context.
func WithStamped(ctx context.Context) context.Context {
	return context.WithValue(ctx, stampedKey{}, true)
}

// Stamped reports whether ctx comes from WithStamped.
func Stamped(ctx context.Context) bool {
	if ctx == nil {
		return false
	}
	v, _ := ctx.Value(stampedKey{}).(bool)
	return v
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
