package middleware

import (
	"errors"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// Errors of the consumer side. The event-id rules (a missing, malformed, nil,
// non-v7 or mismatched id) are publisher's: [publisher.ErrMissingEventID],
// [publisher.ErrInvalidEventID], [publisher.ErrNilEventID],
// [publisher.ErrNotUUIDv7], [publisher.ErrEventIDMismatch], each inside a
// *[publisher.EventIDError]. All of these are permanent ([IsPermanent]
// reports true): redelivery cannot fix the message, so route it to a poison
// topic with watermill's middleware.PoisonQueueWithFilter.
var (
	// ErrStaleEvent: the UUIDv7 time is older than the dedup retention, so a
	// dedup row may already be gone and the middleware cannot vouch that the
	// event was not applied before. The middleware returns it as the Reason
	// of a *publisher.EventIDError whose Value is the id.
	ErrStaleEvent = errors.New("event is older than the dedup retention")
	// ErrMalformedPayload is for handlers: wrap payload decoding failures with
	// it (or with [Permanent]) so they go to the poison queue.
	ErrMalformedPayload = errors.New("malformed payload")
)

// ErrTxAborted: the handler returned nil but left the message's
// transaction unable to commit: one of its statements failed and it
// swallowed the error (PostgreSQL then refuses every statement until
// ROLLBACK, SQLSTATE 25P02), or it ended the transaction itself. The
// middleware rolls back and returns it: the message is retried (it is
// not permanent: the swallowed error may be transient). Handle a failing
// statement you mean to survive in a savepoint (tx.Begin). In group
// commit, only that message goes alone; the rest of its group commits as
// a group.
var ErrTxAborted = errors.New("the handler left its transaction aborted")

// permanentError marks an error that redelivery cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent wraps err so that [IsPermanent] reports true. Handlers use it for
// input they can never process (a payload that fails validation). A nil err
// stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err means the message can never be processed
// and belongs in a poison queue rather than being retried: publisher's
// event-id sentinels (ErrMissingEventID, ErrInvalidEventID, ErrNilEventID,
// ErrNotUUIDv7, ErrEventIDMismatch, whether the middleware or
// publisher.Stamp returned them), [ErrStaleEvent], [ErrMalformedPayload]
// and anything wrapped by [Permanent]. Use it as the filter of watermill's
// PoisonQueueWithFilter and to stop Retry.
func IsPermanent(err error) bool {
	if err == nil {
		return false
	}
	var pe *permanentError
	if errors.As(err, &pe) {
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
	ErrStaleEvent, ErrMalformedPayload,
}
