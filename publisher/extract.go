package publisher

import (
	"bytes"
	"encoding/json"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// EventIDFromMessage reads the event id from the metadata key event_id and
// the top-level JSON payload field eventId; it is the dedup middleware's
// default EventIDFunc. With only one of them present, that one is the id.
// With both, they must name the same UUID: different ids are refused with
// ErrEventIDMismatch, and so is, as ErrInvalidEventID, a payload field that
// is present but not a canonical UUID string (the two cannot be compared).
// A present but empty event_id is ErrMissingEventID, not a reason to read
// the payload. Ids must be canonical 36-character UUIDs (either case).
//
// Like the other extractors, it parses but does not validate: the id may be
// the nil UUID or not a UUIDv7. The middleware applies [ValidateEventID] to
// what its EventIDFunc returns; call it yourself elsewhere. Errors are
// *[EventIDError] values.
func EventIDFromMessage(msg *message.Message) (uuid.UUID, error) {
	v, ok := msg.Metadata[MetadataEventID]
	if !ok {
		return eventIDFromPayload(msg.Payload)
	}
	id, err := fromMetadata(v)
	if err != nil {
		return uuid.Nil, err
	}
	pid, st, err := payloadEventID(msg.Payload)
	if err != nil {
		return uuid.Nil, err
	}
	if st == payloadFound && pid != id {
		return uuid.Nil, mismatchError(id, pid)
	}
	return id, nil
}

// EventIDFromMetadata returns an extractor (an EventIDFunc for the
// middleware) that lets the metadata key event_id win: when the key is
// present the payload is not read, so a payload eventId that differs from
// it (or is not a UUID at all) is ignored instead of refused with
// ErrEventIDMismatch. Use it for producers whose payload eventId is not the
// event's id (for example an upstream event's id copied into a new event).
//
// With payloadFallback, a message without the key has its id read from the
// top-level JSON payload field eventId, as [EventIDFromMessage] reads it;
// without, the payload is never read and a missing key is
// ErrMissingEventID. The extractor parses but does not validate, like
// [EventIDFromMessage].
func EventIDFromMetadata(payloadFallback bool) func(msg *message.Message) (uuid.UUID, error) {
	if payloadFallback {
		return metadataFirst
	}
	return metadataOnly
}

// metadataFirst reads the event id from the metadata key event_id and, only
// when that key is absent, from the payload: [EventIDFromMetadata](true).
func metadataFirst(msg *message.Message) (uuid.UUID, error) {
	if v, ok := msg.Metadata[MetadataEventID]; ok {
		return fromMetadata(v)
	}
	return eventIDFromPayload(msg.Payload)
}

// metadataOnly reads the event id from the metadata key event_id only:
// [EventIDFromMetadata](false).
func metadataOnly(msg *message.Message) (uuid.UUID, error) {
	v, ok := msg.Metadata[MetadataEventID]
	if !ok {
		return uuid.Nil, &EventIDError{Reason: ErrMissingEventID, Source: "metadata", Detail: "no event_id metadata"}
	}
	return fromMetadata(v)
}

// eventIDFromPayload reads the event id from the top-level field eventId of
// a JSON object payload (a leading UTF-8 byte order mark is skipped).
// No id (the payload is empty, not JSON, JSON but not an object, an object
// without the field, or the field is null or "") is ErrMissingEventID. The
// key is matched exactly (case sensitive, after JSON unescaping); a key
// nested deeper is not the field. A field that is present but not a
// canonical UUID string, or that appears twice, is ErrInvalidEventID. It
// parses but does not validate, like [EventIDFromMessage].
//
// A payload without the bytes "eventId" (and without any backslash, which
// could spell the key with escapes) is answered without parsing; otherwise
// it is validated by encoding/json and its top level walked once, without
// decoding or copying the other members' values.
func eventIDFromPayload(payload []byte) (uuid.UUID, error) {
	id, st, err := payloadEventID(payload)
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
	return uuid.Nil, &EventIDError{Reason: ErrMissingEventID, Source: "payload", Detail: detail}
}

// mismatchError is the error for a message whose event_id metadata and
// payload eventId name different ids.
func mismatchError(metadata, payload uuid.UUID) *EventIDError {
	return &EventIDError{Reason: ErrEventIDMismatch, Source: "payload", Value: payload.String(),
		Detail: "the event_id metadata is " + metadata.String()}
}

func fromMetadata(v string) (uuid.UUID, error) {
	if v == "" {
		return uuid.Nil, &EventIDError{Reason: ErrMissingEventID, Source: "metadata", Detail: "event_id metadata is present but empty"}
	}
	id, err := parseCanonical(v)
	if err != nil {
		return uuid.Nil, &EventIDError{Reason: err, Source: "metadata", Value: truncate(v)}
	}
	return id, nil
}

// payloadState says what payloadEventID found.
type payloadState uint8

const (
	payloadNoKey     payloadState = iota // no eventId key (the payload may not even be JSON)
	payloadNotObject                     // empty, not JSON, or JSON that is not an object
	payloadNull                          // "eventId": null
	payloadEmpty                         // "eventId": ""
	payloadDuplicate                     // eventId appears more than once
	payloadFound                         // a canonical UUID string
)

var quotedPayloadField = []byte(`"` + PayloadEventIDField + `"`)

// payloadEventID reads the top-level field eventId of payload: the id
// (payloadFound), or why there is none, or an *EventIDError (Source
// "payload") for a field that is present but unusable. See [eventIDFromPayload].
func payloadEventID(payload []byte) (uuid.UUID, payloadState, error) {
	raw, st := topLevelField(payload)
	switch {
	case st == payloadDuplicate:
		return uuid.Nil, st, &EventIDError{Reason: ErrInvalidEventID, Source: "payload", Detail: "eventId appears more than once in the JSON object"}
	case st != payloadFound:
		return uuid.Nil, st, nil
	case string(raw) == "null":
		return uuid.Nil, payloadNull, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return uuid.Nil, st, &EventIDError{Reason: ErrInvalidEventID, Source: "payload", Value: truncate(string(raw)), Detail: "eventId is not a JSON string"}
	}
	if s == "" {
		return uuid.Nil, payloadEmpty, nil
	}
	id, err := parseCanonical(s)
	if err != nil {
		return uuid.Nil, st, &EventIDError{Reason: err, Source: "payload", Value: truncate(s)}
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
	payload = trimBOM(payload)
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
// spells PayloadEventIDField, escapes resolved.
func isPayloadField(key []byte) bool {
	if bytes.IndexByte(key, '\\') < 0 {
		return string(key[1:len(key)-1]) == PayloadEventIDField
	}
	var s string
	return json.Unmarshal(key, &s) == nil && s == PayloadEventIDField
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

// isJSONObject reports whether payload is one valid JSON object (after a
// UTF-8 byte order mark, if any).
func isJSONObject(payload []byte) bool {
	payload = trimBOM(payload)
	b := bytes.TrimLeft(payload, " \t\r\n")
	return len(b) > 0 && b[0] == '{' && json.Valid(payload)
}

// utf8BOM is the UTF-8 byte order mark, U+FEFF.
var utf8BOM = []byte("\xef\xbb\xbf")

// trimBOM drops a leading UTF-8 byte order mark. RFC 8259 §8.1 lets a parser
// ignore it; producers that write one (Windows tools, some .NET and
// PowerShell serializers) mean the JSON after it, so the eventId there is
// the event's id for Stamp and for the extractors alike.
func trimBOM(payload []byte) []byte {
	return bytes.TrimPrefix(payload, utf8BOM)
}
