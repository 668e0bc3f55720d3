package middleware

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// ErrNotInHandler is returned when the context does not come from a handler
// wrapped by the dedup middleware, so there is no message transaction and no
// event: by [IdempotencyKey] and the [IdempotencyKeyTransport] (no key to
// derive; the request is not sent), by outbox.PublisherFromContext (no
// transaction to write in), and it is the value [MustTxFromContext] panics
// with. Use msg.Context() of the handled message, or a context derived from
// it.
var ErrNotInHandler = idemctx.ErrNotInHandler

// TxFromContext returns the transaction the dedup middleware opened for the
// message being handled. Run every business write of the handler on it: it
// commits together with the event's claim.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	v := idemctx.From(ctx)
	if v == nil || v.Tx == nil {
		return nil, false
	}
	return v.Tx, true
}

// MustTxFromContext is [TxFromContext] for handlers that cannot work without
// the transaction. It panics with [ErrNotInHandler] when ctx has none.
func MustTxFromContext(ctx context.Context) pgx.Tx {
	tx, ok := TxFromContext(ctx)
	if !ok {
		panic(ErrNotInHandler)
	}
	return tx
}

// EventIDFromContext returns the validated event id of the message being
// handled.
func EventIDFromContext(ctx context.Context) (uuid.UUID, bool) {
	v := idemctx.From(ctx)
	if v == nil {
		return uuid.Nil, false
	}
	return v.EventID, true
}
