package middleware

import (
	"errors"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/payloaderr"
	"github.com/idemkit/watermill-idempotency/internal/permanent"
	"github.com/idemkit/watermill-idempotency/internal/sqltx"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// The errors of the middleware. The event-id rules (a missing, malformed,
// nil, non-v7 or mismatched id) are publisher's: [publisher.ErrMissingEventID],
// [publisher.ErrInvalidEventID], [publisher.ErrNilEventID],
// [publisher.ErrNotUUIDv7], [publisher.ErrEventIDMismatch], each inside a
// *[publisher.EventIDError]; the stale rule's is deduplicator.ErrStaleEvent.
// These and [ErrMalformedPayload] are permanent ([IsPermanent] reports true):
// redelivery cannot fix the message, so route it to a poison topic with
// watermill's middleware.PoisonQueueWithFilter.
var (
	// ErrMalformedPayload is for handlers: wrap payload decoding failures with
	// it (or with [Permanent]) so they go to the poison queue. contract's
	// refusals unwrap to this same value.
	ErrMalformedPayload = payloaderr.ErrMalformed

	// ErrTxAborted: the handler returned nil but left the message's
	// transaction unable to commit: one of its statements failed and it
	// swallowed the error (PostgreSQL then refuses every statement until
	// ROLLBACK, SQLSTATE 25P02), or it ended the transaction itself. The
	// middleware rolls back and returns it: the message is retried (it is
	// not permanent: the swallowed error may be transient). Handle a failing
	// statement you mean to survive in a savepoint (tx.Begin). In group
	// commit, only that message goes alone; the rest of its group commits as
	// a group.
	ErrTxAborted = errors.New("the handler left its transaction aborted")

	// ErrNotInHandler is returned when the context does not come from a
	// handler wrapped by the dedup middleware, so there is no message
	// transaction and no event: by [IdempotencyKey] and the
	// [IdempotencyKeyTransport] (no key to derive; the request is not sent),
	// by outbox.PublisherFromContext (no transaction to write in), and it is
	// the value [MustTxFromContext] panics with. Use msg.Context() of the
	// handled message, or a context derived from it.
	ErrNotInHandler = idemctx.ErrNotInHandler

	// ErrUnsupportedDriver: [SQLDB] got a *sql.DB that was not opened with
	// pgx's stdlib driver (github.com/jackc/pgx/v5/stdlib). The library's
	// own statements are pgx's, run on the handler's connection, and no
	// other driver (lib/pq) gives that connection.
	ErrUnsupportedDriver = sqltx.ErrUnsupportedDriver

	// ErrLeaseLost (lease mode): the delivery's lease was taken over by
	// another delivery after it expired (the handler ran longer than the
	// lease and its renewals failed), or an operator released it. Nothing
	// the handler registered with [Complete] was written; the middleware
	// returns it (retryable: the redelivery finds the event done, or takes
	// a new lease), and a renewal that finds it cancels the handler's
	// context with it as the cause.
	ErrLeaseLost = errors.New("lease lost")

	// ErrLeaseBusy (lease mode): another delivery of the event holds a live
	// lease, and it did not end within [LeaseConfig.BusyWait]. The handler
	// did not run; the message is retried (it is not permanent).
	ErrLeaseBusy = errors.New("another delivery holds the event's lease")

	// ErrPoolTooSmall is the start-up refusal of a pool whose MaxConns
	// cannot cover [Config.Concurrency]; the error wrapping it gives the
	// pool's size and the connections needed.
	ErrPoolTooSmall = errors.New("pool too small for the declared concurrency")
)

// Permanent wraps err so that [IsPermanent] reports true. Handlers use it for
// input they can never process (a payload that fails validation). A nil err
// stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanent.Mark(err) // the leaf internal/permanent: idemkafka/franz marks and reads it too
}

// IsPermanent reports whether err means the message can never be processed
// and belongs in a poison queue rather than being retried: publisher's
// event-id sentinels (ErrMissingEventID, ErrInvalidEventID, ErrNilEventID,
// ErrNotUUIDv7, ErrEventIDMismatch, whether the middleware or
// publisher.Stamp returned them), publisher's ErrMessageTooLarge and
// ErrReservedMetadata (an outbox write the broker would refuse),
// deduplicator.ErrStaleEvent (the stale rule), [ErrMalformedPayload] and
// anything wrapped by [Permanent]. Use it as the filter of watermill's
// PoisonQueueWithFilter and to stop Retry.
func IsPermanent(err error) bool {
	if err == nil {
		return false
	}
	if permanent.Marked(err) {
		return true
	}
	for _, s := range permanentSentinels {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

var permanentSentinels = []error{
	publisher.ErrMissingEventID, publisher.ErrInvalidEventID, publisher.ErrNilEventID,
	publisher.ErrNotUUIDv7, publisher.ErrEventIDMismatch,
	publisher.ErrMessageTooLarge, publisher.ErrReservedMetadata,
	deduplicator.ErrStaleEvent, ErrMalformedPayload,
}
