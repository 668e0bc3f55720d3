package middleware

import (
	"errors"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
)

// Sentinel errors for messages the middleware refuses. Each is permanent
// ([IsPermanent] reports true): redelivery cannot fix the message, so route it
// to a poison topic with watermill's middleware.PoisonQueueWithFilter.
var (
	// ErrMissingEventID: no event_id metadata and no eventId JSON field, or an empty one.
	ErrMissingEventID = eventid.ErrMissing
	// ErrInvalidEventID: the id is not a canonical UUID string.
	ErrInvalidEventID = eventid.ErrInvalid
	// ErrNilEventID: the id is 00000000-0000-0000-0000-000000000000.
	ErrNilEventID = eventid.ErrNil
	// ErrNotUUIDv7: a valid UUID of another version while UUIDv7 is required.
	ErrNotUUIDv7 = eventid.ErrNotV7
	// ErrEventIDMismatch: the event_id metadata and the JSON payload field
	// eventId name different ids. [DefaultEventIDFunc] and the publisher's
	// stamping refuse to choose; [HeaderFirstEventIDFunc] lets the metadata win.
	ErrEventIDMismatch = eventid.ErrMismatch
	// ErrStaleEvent: the UUIDv7 time is older than the dedup retention, so a
	// dedup row may already be gone and the middleware cannot vouch that the
	// event was not applied before.
	ErrStaleEvent = eventid.ErrStale
	// ErrMalformedPayload is for handlers: wrap payload decoding failures with
	// it (or with [Permanent]) so they go to the poison queue.
	ErrMalformedPayload = eventid.ErrMalformedPayload
)

// EventIDError tells why a message's event id was refused; it unwraps to one of
// the sentinel errors above. Fields: Reason (the sentinel), Source ("metadata",
// "payload" or "func"), Value (the offending value, truncated), Detail.
type EventIDError = eventid.Error

// PermanentError marks an error that redelivery cannot fix.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that [IsPermanent] reports true. Handlers use it for
// input they can never process (a payload that fails validation). A nil err
// stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err means the message can never be processed
// and belongs in a poison queue rather than being retried: the event-id
// errors (ErrEventIDMismatch included), ErrStaleEvent, ErrMalformedPayload and anything wrapped by
// [Permanent]. Use it as the filter of watermill's PoisonQueueWithFilter.
func IsPermanent(err error) bool {
	if err == nil {
		return false
	}
	var pe *PermanentError
	if errors.As(err, &pe) {
		return true
	}
	for _, s := range []error{ErrMissingEventID, ErrInvalidEventID, ErrNilEventID, ErrNotUUIDv7, ErrEventIDMismatch, ErrStaleEvent, ErrMalformedPayload} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}
