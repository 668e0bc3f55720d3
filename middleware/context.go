package middleware

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

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
