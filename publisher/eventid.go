package publisher

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Metadata keys written on every outgoing message (Kafka headers) and read
// by the dedup middleware.
const (
	// MetadataEventID carries the UUIDv7 event id, the consumer's dedup key.
	MetadataEventID = "event_id"
	// MetadataOccurredAt is the RFC 3339 time the event was stamped.
	MetadataOccurredAt = "occurred_at"
	// MetadataCausationID is the event id of the message whose handler
	// produced this one.
	MetadataCausationID = "causation_id"
	// MetadataCorrelationID is carried unchanged through a chain of events.
	MetadataCorrelationID = "correlation_id"
	// MetadataPartitionKey becomes the Kafka record key (the aggregate id), so
	// all events of one aggregate land in one partition, in order.
	MetadataPartitionKey = "partition_key"
	// PayloadEventIDField is the top-level JSON payload field that carries
	// the event id when the producer did not set the event_id header (and
	// that must agree with the header when both are present).
	PayloadEventIDField = "eventId"
)

// Sentinel errors of the event-id rules, the Reason of an [EventIDError].
// Each is permanent: redelivering the message cannot fix it, so the
// middleware's IsPermanent reports true and a poison queue takes the message.
var (
	// ErrMissingEventID: no event_id metadata and no eventId JSON field, or
	// an empty (or null) one.
	ErrMissingEventID = errors.New("event id missing")
	// ErrInvalidEventID: the id is not a canonical UUID string (36
	// characters, hyphenated, either case; no braces, "urn:uuid:" or
	// surrounding spaces), or a UUID of a non-RFC 4122 variant.
	ErrInvalidEventID = errors.New("event id is not a valid canonical UUID")
	// ErrNilEventID: the id is 00000000-0000-0000-0000-000000000000.
	ErrNilEventID = errors.New("event id is the nil UUID")
	// ErrNotUUIDv7: a valid UUID of another version where a UUIDv7 is
	// required.
	ErrNotUUIDv7 = errors.New("event id is not a UUIDv7")
	// ErrEventIDMismatch: the event_id metadata and the JSON payload field
	// eventId name different ids. [EventIDFromMessage] and [Stamp] refuse to
	// choose; [EventIDFromMetadata] lets the metadata win.
	ErrEventIDMismatch = errors.New("event_id metadata and payload eventId disagree")
)

// EventIDError tells why a message's event id was refused. It is returned by
// [Stamp], [ParseEventID], [ValidateEventID] and the EventIDFrom* functions,
// and by the dedup middleware for every message it refuses before a
// transaction. It unwraps to its Reason, so errors.Is matches the sentinel.
type EventIDError struct {
	// Reason is the sentinel: ErrMissingEventID, ErrInvalidEventID,
	// ErrNilEventID, ErrNotUUIDv7 or ErrEventIDMismatch; or, from the dedup
	// middleware's stale guard, its ErrStaleEvent.
	Reason error
	// Source is where the id was read: "metadata" (the event_id header),
	// "payload" (the JSON field eventId), "func" (the middleware wrapping a
	// plain error of a custom EventIDFunc), or "" when a parsed id was
	// checked on its own (not nil, version 7, not stale).
	Source string
	// Value is the offending value as received, cut to its first 64 bytes
	// (followed by "…") so that an error, a log line or a poison-queue
	// reason never carries an unbounded, untrusted string. Empty when
	// there was no value (a missing id).
	Value string
	// Detail says more for a human (the other id of a mismatch, why Stamp
	// refused); it may be empty.
	Detail string
}

func (e *EventIDError) Error() string {
	var b strings.Builder
	b.WriteString(e.Reason.Error())
	if e.Source != "" {
		b.WriteString(" (")
		b.WriteString(e.Source)
		b.WriteString(")")
	}
	if e.Value != "" {
		fmt.Fprintf(&b, ": %q", e.Value)
	}
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	return b.String()
}

// Unwrap returns the Reason.
func (e *EventIDError) Unwrap() error { return e.Reason }

// maxValueLen bounds EventIDError.Value: values are cut when the error is
// built, so the struct, not only its rendering, stays small.
const maxValueLen = 64

// truncate cuts s to at most maxValueLen bytes, at a rune boundary, and
// marks the cut with "…".
func truncate(s string) string {
	if len(s) <= maxValueLen {
		return s
	}
	i := maxValueLen
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "…"
}

// NewEventID returns a new UUIDv7. Ids from one process are strictly
// increasing (google/uuid keeps a monotonic sub-millisecond counter), so they
// sort by creation time and insert at the right edge of a B-tree.
func NewEventID() uuid.UUID {
	return uuid.Must(uuid.NewV7())
}

// ParseEventID parses s as an event id: a canonical UUID string (see
// [ErrInvalidEventID]) naming a non-nil UUIDv7. The error is an
// *[EventIDError] wrapping ErrInvalidEventID, ErrNilEventID or ErrNotUUIDv7.
func ParseEventID(s string) (uuid.UUID, error) {
	id, err := parseCanonical(s)
	if err == nil {
		err = validate(id, false)
	}
	if err != nil {
		return uuid.Nil, &EventIDError{Reason: err, Value: truncate(s)}
	}
	return id, nil
}

// ValidateEventID checks an id already parsed (by an EventIDFrom* function
// or a custom extractor): not the nil UUID, of the RFC 4122 variant, and
// version 7 unless allowNonV7. The error is an *[EventIDError] wrapping
// ErrNilEventID, ErrInvalidEventID or ErrNotUUIDv7. The dedup middleware
// applies it to every extracted id (allowNonV7 is its Config.AllowNonV7).
func ValidateEventID(id uuid.UUID, allowNonV7 bool) error {
	if err := validate(id, allowNonV7); err != nil {
		return &EventIDError{Reason: err, Value: id.String()}
	}
	return nil
}

// parseCanonical parses s as a UUID in its canonical 36-character hyphenated
// form (either case); it returns ErrInvalidEventID otherwise. Braces,
// "urn:uuid:" prefixes, missing hyphens and surrounding spaces are refused:
// they indicate a producer that does not follow the contract, and accepting
// them would hide it.
func parseCanonical(s string) (uuid.UUID, error) {
	if len(s) != 36 {
		return uuid.Nil, ErrInvalidEventID
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, ErrInvalidEventID
	}
	return id, nil
}

// validate is ValidateEventID returning the bare sentinel.
func validate(id uuid.UUID, allowNonV7 bool) error {
	if id == uuid.Nil {
		return ErrNilEventID
	}
	if id.Variant() != uuid.RFC4122 {
		return ErrInvalidEventID
	}
	if !allowNonV7 && id.Version() != 7 {
		return ErrNotUUIDv7
	}
	return nil
}
