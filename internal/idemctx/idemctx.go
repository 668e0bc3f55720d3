// Package idemctx carries the dedup middleware's per-message state (the
// transaction, the event id, the consumer group) in a context.Context, so the
// outbox finds the transaction without importing the middleware.
package idemctx

import (
	"context"
	"errors"

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
