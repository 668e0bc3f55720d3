// Package eventid holds the event-id rules shared by the middleware (which
// validates ids) and the publisher (which stamps them): metadata names, the
// sentinel errors and strict parsing.
package eventid

import (
	"bytes"
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
	// ErrMismatch: the event_id metadata and the JSON payload field eventId
	// are both present and name different ids.
	ErrMismatch = errors.New("event_id metadata and payload eventId disagree")
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

// FromMessage extracts the event id from the metadata key event_id and the
// top-level JSON payload field eventId. With only one of them present, that
// one is the id. With both, they must name the same UUID: different ids are
// an *Error wrapping ErrMismatch, and a payload field that is present but not
// a canonical UUID string is refused too (the two cannot be checked against
// each other). A present but empty event_id is ErrMissing. It parses but does
// not Validate.
func FromMessage(msg *message.Message) (uuid.UUID, error) {
	v, ok := msg.Metadata[MetadataEventID]
	if !ok {
		return FromPayload(msg.Payload)
	}
	id, err := fromMetadata(v)
	if err != nil {
		return uuid.Nil, err
	}
	pid, found, err := PayloadID(msg.Payload)
	if err != nil {
		return uuid.Nil, err
	}
	if found && pid != id {
		return uuid.Nil, MismatchError(id, pid)
	}
	return id, nil
}

// FromMessageHeaderFirst extracts the event id from the metadata key
// event_id, falling back to the top-level JSON payload field eventId only
// when the key is absent; the payload is not read when the key is present.
// It parses but does not Validate.
func FromMessageHeaderFirst(msg *message.Message) (uuid.UUID, error) {
	if v, ok := msg.Metadata[MetadataEventID]; ok {
		return fromMetadata(v)
	}
	return FromPayload(msg.Payload)
}

// MismatchError is the *Error for a message whose event_id metadata and
// payload eventId name different ids.
func MismatchError(metadata, payload uuid.UUID) *Error {
	return &Error{Reason: ErrMismatch, Source: "payload", Value: payload.String(),
		Detail: "the event_id metadata is " + metadata.String()}
}

func fromMetadata(v string) (uuid.UUID, error) {
	if v == "" {
		return uuid.Nil, &Error{Reason: ErrMissing, Source: "metadata", Detail: "event_id metadata is present but empty"}
	}
	id, err := Parse(v)
	if err != nil {
		return uuid.Nil, &Error{Reason: err, Source: "metadata", Value: truncate(v)}
	}
	return id, nil
}

// FromPayload extracts the top-level JSON field eventId from payload; its
// absence (or a null or empty value) is ErrMissing. See [PayloadID].
func FromPayload(payload []byte) (uuid.UUID, error) {
	id, st, err := payloadID(payload)
	if err != nil {
		return uuid.Nil, err
	}
	var detail string
	switch st {
	case payloadFound:
		return id, nil
	case payloadNull:
		detail = "eventId is null"
	case payloadEmpty:
		detail = "eventId is empty"
	default:
		switch {
		case len(payload) == 0:
			detail = "no event_id metadata and an empty payload"
		case st == payloadNotObject || !isJSONObject(payload):
			detail = "no event_id metadata and the payload is not a JSON object"
		default:
			detail = "no event_id metadata and no eventId field in the JSON payload"
		}
	}
	return uuid.Nil, &Error{Reason: ErrMissing, Source: "payload", Detail: detail}
}

// PayloadID reads the event id from the top-level field eventId of a JSON
// object payload. found is false, with a nil error, when there is no id:
// the payload is empty, not JSON, JSON but not an object, an object without
// the field, or the field is null or "". The key is matched exactly (case
// sensitive, after JSON unescaping); a key nested deeper is not the field. A
// field that is present but not a canonical UUID string, or that appears
// twice, is an *Error (Source "payload"). It parses but does not Validate.
//
// A payload without the bytes "eventId" (and without any backslash, which
// could spell the key with escapes) is answered without parsing; otherwise
// it is validated by encoding/json and its top level walked once, without
// decoding or copying the other members' values.
func PayloadID(payload []byte) (id uuid.UUID, found bool, err error) {
	id, st, err := payloadID(payload)
	return id, err == nil && st == payloadFound, err
}

// payloadState says what payloadID found.
type payloadState uint8

const (
	payloadNoKey     payloadState = iota // no eventId key (the payload may not even be JSON)
	payloadNotObject                     // empty, not JSON, or JSON that is not an object
	payloadNull                          // "eventId": null
	payloadEmpty                         // "eventId": ""
	payloadDuplicate                     // eventId appears more than once
	payloadFound                         // a canonical UUID string
)

var quotedPayloadField = []byte(`"` + PayloadField + `"`)

func payloadID(payload []byte) (uuid.UUID, payloadState, error) {
	raw, st := topLevelField(payload)
	switch {
	case st == payloadDuplicate:
		return uuid.Nil, st, &Error{Reason: ErrInvalid, Source: "payload", Detail: "eventId appears more than once in the JSON object"}
	case st != payloadFound:
		return uuid.Nil, st, nil
	case string(raw) == "null":
		return uuid.Nil, payloadNull, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return uuid.Nil, st, &Error{Reason: ErrInvalid, Source: "payload", Value: truncate(string(raw)), Detail: "eventId is not a JSON string"}
	}
	if s == "" {
		return uuid.Nil, payloadEmpty, nil
	}
	id, err := Parse(s)
	if err != nil {
		return uuid.Nil, st, &Error{Reason: err, Source: "payload", Value: truncate(s)}
	}
	return id, payloadFound, nil
}

// topLevelField returns the raw JSON value of the top-level member eventId
// of payload (state payloadFound), or why there is none.
//
// encoding/json validates the whole payload first (json.Valid: one scan, no
// allocation); the walk below then only has to find the extent of each
// top-level member in input known to be valid JSON, skipping values without
// decoding them. Keys are compared after JSON unescaping.
func topLevelField(payload []byte) ([]byte, payloadState) {
	if !bytes.Contains(payload, quotedPayloadField) && bytes.IndexByte(payload, '\\') < 0 {
		return nil, payloadNoKey
	}
	if !json.Valid(payload) {
		return nil, payloadNotObject
	}
	i := skipSpace(payload, 0)
	if payload[i] != '{' {
		return nil, payloadNotObject
	}
	var raw []byte
	n := 0
	for i = skipSpace(payload, i+1); payload[i] != '}'; {
		keyEnd := stringEnd(payload, i)
		key := payload[i:keyEnd]
		i = skipSpace(payload, keyEnd) + 1 // the colon
		i = skipSpace(payload, i)
		end := valueEnd(payload, i)
		if isPayloadField(key) {
			n++
			raw = payload[i:end]
		}
		i = skipSpace(payload, end)
		if payload[i] == ',' {
			i = skipSpace(payload, i+1)
		}
	}
	switch n {
	case 0:
		return nil, payloadNoKey
	case 1:
		return raw, payloadFound
	default:
		return nil, payloadDuplicate
	}
}

// isPayloadField reports whether the JSON string key (quotes included)
// spells PayloadField, escapes resolved.
func isPayloadField(key []byte) bool {
	if bytes.IndexByte(key, '\\') < 0 {
		return string(key[1:len(key)-1]) == PayloadField
	}
	var s string
	return json.Unmarshal(key, &s) == nil && s == PayloadField
}

// The helpers below walk JSON already checked by json.Valid, so they need
// no bounds or syntax checks of their own.

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index just after the string starting at b[i] == '"'.
func stringEnd(b []byte, i int) int {
	for i++; ; {
		i += bytes.IndexAny(b[i:], `"\`)
		if b[i] == '"' {
			return i + 1
		}
		i += 2 // a backslash and the escaped byte (\uXXXX's hex digits need no care)
	}
}

// valueEnd returns the index just after the value starting at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for {
			switch b[i] {
			case '"':
				i = stringEnd(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
	default: // number, true, false, null
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return i
	}
}

// isJSONObject reports whether payload is one valid JSON object.
func isJSONObject(payload []byte) bool {
	b := bytes.TrimLeft(payload, " \t\r\n")
	return len(b) > 0 && b[0] == '{' && json.Valid(payload)
}
