// Package eventid holds the event-id rules shared by the middleware (which
// validates ids) and the publisher (which stamps them): metadata names, the
// sentinel errors and strict parsing.
package eventid

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// Metadata keys (Kafka headers) written by the publisher and read by the middleware.
const (
	MetadataEventID       = "event_id"
	MetadataOccurredAt    = "occurred_at"
	MetadataCausationID   = "causation_id"
	MetadataCorrelationID = "correlation_id"
	MetadataPartitionKey  = "partition_key"
	// PayloadField is the JSON payload field read when the metadata key is absent.
	PayloadField = "eventId"
)

// Sentinel errors. All of them are permanent: redelivering the message cannot fix them.
var (
	ErrMissing          = errors.New("event id missing")
	ErrInvalid          = errors.New("event id is not a valid canonical UUID")
	ErrNil              = errors.New("event id is the nil UUID")
	ErrNotV7            = errors.New("event id is not a UUIDv7")
	ErrStale            = errors.New("event is older than the dedup retention")
	ErrMalformedPayload = errors.New("malformed payload")
)

// Error describes why a message's event id was refused. It unwraps to one of
// the sentinel errors.
type Error struct {
	// Reason is one of the sentinel errors.
	Reason error
	// Source is where the id was looked for: "metadata", "payload" or "func".
	Source string
	// Value is the offending value, truncated to 64 bytes.
	Value string
	// Detail adds context, may be empty.
	Detail string
}

func (e *Error) Error() string {
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

func (e *Error) Unwrap() error { return e.Reason }

func truncate(s string) string {
	const max = 64
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
}

// Parse parses s as a UUID in its canonical 36-character hyphenated form
// (either case). Braces, "urn:uuid:" prefixes, missing hyphens and surrounding
// spaces are refused: they indicate a producer that does not follow the
// contract, and accepting them would hide it.
func Parse(s string) (uuid.UUID, error) {
	if len(s) != 36 {
		return uuid.Nil, ErrInvalid
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, ErrInvalid
	}
	return id, nil
}

// Validate checks an already parsed id: not nil, and version 7 unless
// allowNonV7. It also refuses UUIDs with a non-RFC variant.
func Validate(id uuid.UUID, allowNonV7 bool) error {
	if id == uuid.Nil {
		return ErrNil
	}
	if id.Variant() != uuid.RFC4122 {
		return ErrInvalid
	}
	if !allowNonV7 && id.Version() != 7 {
		return ErrNotV7
	}
	return nil
}

// FromMessage extracts the event id from the metadata key event_id, falling
// back to the top-level JSON payload field eventId when the key is absent. It
// parses but does not Validate.
func FromMessage(msg *message.Message) (uuid.UUID, error) {
	if v, ok := msg.Metadata[MetadataEventID]; ok {
		if v == "" {
			return uuid.Nil, &Error{Reason: ErrMissing, Source: "metadata", Detail: "event_id metadata is present but empty"}
		}
		id, err := Parse(v)
		if err != nil {
			return uuid.Nil, &Error{Reason: err, Source: "metadata", Value: truncate(v)}
		}
		return id, nil
	}
	return FromPayload(msg.Payload)
}

// FromPayload extracts the top-level JSON field eventId from payload.
func FromPayload(payload []byte) (uuid.UUID, error) {
	if len(payload) == 0 {
		return uuid.Nil, &Error{Reason: ErrMissing, Source: "payload", Detail: "no event_id metadata and an empty payload"}
	}
	var p struct {
		EventID *json.RawMessage `json:"eventId"`
	}
	if err := json.Unmarshal(payload, &p); err != nil {
		return uuid.Nil, &Error{Reason: ErrMissing, Source: "payload", Detail: "no event_id metadata and the payload is not a JSON object"}
	}
	if p.EventID == nil {
		return uuid.Nil, &Error{Reason: ErrMissing, Source: "payload", Detail: "no event_id metadata and no eventId field in the JSON payload"}
	}
	var s string
	if err := json.Unmarshal(*p.EventID, &s); err != nil {
		return uuid.Nil, &Error{Reason: ErrInvalid, Source: "payload", Value: truncate(string(*p.EventID)), Detail: "eventId is not a JSON string"}
	}
	if s == "" {
		return uuid.Nil, &Error{Reason: ErrMissing, Source: "payload", Detail: "eventId is empty"}
	}
	id, err := Parse(s)
	if err != nil {
		return uuid.Nil, &Error{Reason: err, Source: "payload", Value: truncate(s)}
	}
	return id, nil
}
