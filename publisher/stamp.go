package publisher

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// Stamp gives msg the metadata every event must carry, following the
// stamping rule, and returns its event id:
//
//   - event_id: an existing valid UUIDv7 is kept; an existing but invalid,
//     nil or non-v7 value is an error (*[EventIDError]), never silently
//     replaced, because another copy of the same event may already be out
//     with it. Otherwise a UUIDv7 in the payload's top-level JSON field
//     eventId is copied (the event's own id: publishing the same payload
//     twice gives one event id), else msg.UUID is reused when it is a
//     UUIDv7, else a new UUIDv7 is generated. An empty event_id counts as
//     absent.
//   - a payload eventId that is present but not a canonical UUIDv7 string
//     is an error, and so is one that differs from the event_id metadata
//     (ErrEventIDMismatch): Stamp never chooses between two ids. A null or
//     empty eventId, a payload that is not JSON or not a JSON object, and a
//     field nested deeper count as no payload id. A UTF-8 byte order mark
//     before the JSON is skipped, as the extractors skip it.
//   - msg.UUID is never overwritten; an empty one is set to the event id.
//   - occurred_at: the current UTC time in RFC 3339 (nanoseconds), unless set.
//   - causation_id: when ctx comes from a handler wrapped by the dedup
//     middleware, the incoming event's id, unless set.
//   - correlation_id: unless set, the incoming message's correlation id, or
//     the incoming event id when that message had none (it started the
//     chain).
//   - traceparent, tracestate, baggage (W3C): the trace of ctx, when it
//     carries a span and the message no traceparent yet, so consumers
//     continue the producer's trace (see docs/observability.md).
//
// An error is an *[EventIDError] wrapping ErrInvalidEventID, ErrNilEventID,
// ErrNotUUIDv7 or ErrEventIDMismatch (all permanent for the middleware's
// IsPermanent), and msg is then left unchanged (apart from a nil Metadata
// becoming empty). Stamp is idempotent: stamping a stamped message changes nothing.
func Stamp(ctx context.Context, msg *message.Message) (uuid.UUID, error) {
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	id, err := stampEventID(msg)
	if err != nil {
		return uuid.Nil, err
	}
	if msg.UUID == "" {
		msg.UUID = id.String()
	}
	if msg.Metadata.Get(MetadataOccurredAt) == "" {
		msg.Metadata.Set(MetadataOccurredAt, time.Now().UTC().Format(time.RFC3339Nano))
	}
	if in := idemctx.From(ctx); in != nil && in.EventID != uuid.Nil {
		if msg.Metadata.Get(MetadataCausationID) == "" {
			msg.Metadata.Set(MetadataCausationID, in.EventID.String())
		}
		if msg.Metadata.Get(MetadataCorrelationID) == "" {
			corr := in.CorrelationID
			if corr == "" {
				corr = in.EventID.String()
			}
			msg.Metadata.Set(MetadataCorrelationID, corr)
		}
	}
	// The trace the message is created in (inside a dedup handler: the
	// consumed message's) travels with it: traceparent, tracestate and
	// baggage, unless the message already carries a traceparent.
	otelx.Inject(ctx, msg)
	return id, nil
}

func stampEventID(msg *message.Message) (uuid.UUID, error) {
	var header uuid.UUID
	if v := msg.Metadata.Get(MetadataEventID); v != "" {
		id, err := parseCanonical(v)
		if err == nil {
			err = validate(id, false)
		}
		if err != nil {
			return uuid.Nil, &EventIDError{Reason: err, Source: "metadata", Value: truncate(v),
				Detail: "message " + truncate(msg.UUID) + " already has an event_id that is not a valid UUIDv7; Stamp does not replace it"}
		}
		header = id
	}
	payload, st, err := payloadEventID(msg.Payload)
	if err != nil {
		return uuid.Nil, err
	}
	inPayload := st == payloadFound
	if inPayload {
		if err := validate(payload, false); err != nil {
			return uuid.Nil, &EventIDError{Reason: err, Source: "payload", Value: payload.String(),
				Detail: "the payload's eventId must be a UUIDv7"}
		}
	}
	switch {
	case header != uuid.Nil && inPayload && header != payload:
		return uuid.Nil, mismatchError(header, payload)
	case header != uuid.Nil:
		return header, nil
	case inPayload:
		msg.Metadata.Set(MetadataEventID, payload.String())
		return payload, nil
	}
	if id, err := parseCanonical(msg.UUID); err == nil && validate(id, false) == nil {
		msg.Metadata.Set(MetadataEventID, id.String())
		return id, nil
	}
	id := NewEventID()
	msg.Metadata.Set(MetadataEventID, id.String())
	return id, nil
}

// WithPartitionKey sets the partition_key metadata to aggregateID and returns
// msg. The Kafka marshaler of this package uses it as the record key, so all
// events of one aggregate go to one partition, in order.
func WithPartitionKey(msg *message.Message, aggregateID string) *message.Message {
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(MetadataPartitionKey, aggregateID)
	return msg
}
