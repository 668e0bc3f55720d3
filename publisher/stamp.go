package publisher

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// StampError is returned by [Stamp] for a message whose existing event_id
// metadata is unusable. It is the same type as the middleware's
// EventIDError and unwraps to one of its sentinels (ErrInvalidEventID,
// ErrNilEventID, ErrNotUUIDv7), so middleware.IsPermanent reports true.
type StampError = eventid.Error

// Stamp gives msg the metadata every event must carry, following the
// stamping rule, and returns its event id:
//
//   - event_id: an existing valid UUIDv7 is kept; an existing but invalid,
//     nil or non-v7 value is an error (*StampError), never silently
//     replaced, because another copy of the same event may already be out
//     with it. Otherwise msg.UUID is reused when it is a UUIDv7, else a new
//     UUIDv7 is generated. An empty event_id counts as absent.
//   - msg.UUID is never overwritten; an empty one is set to the event id.
//   - occurred_at: the current UTC time in RFC 3339 (nanoseconds), unless set.
//   - causation_id: when ctx comes from a handler wrapped by the dedup
//     middleware, the incoming event's id, unless set.
//   - correlation_id: unless set, the incoming message's correlation id, or
//     the incoming event id when that message had none (it started the
//     chain).
//
// Stamp is idempotent: stamping a stamped message changes nothing.
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
	return id, nil
}

func stampEventID(msg *message.Message) (uuid.UUID, error) {
	if v := msg.Metadata.Get(MetadataEventID); v != "" {
		id, err := eventid.Parse(v)
		if err == nil {
			err = eventid.Validate(id, false)
		}
		if err != nil {
			return uuid.Nil, &StampError{Reason: err, Source: "metadata", Value: truncate(v),
				Detail: "message " + truncate(msg.UUID) + " already has an event_id that is not a valid UUIDv7; Stamp does not replace it"}
		}
		return id, nil
	}
	if id, err := eventid.Parse(msg.UUID); err == nil && eventid.Validate(id, false) == nil {
		msg.Metadata.Set(MetadataEventID, id.String())
		return id, nil
	}
	id := NewEventID()
	msg.Metadata.Set(MetadataEventID, id.String())
	return id, nil
}

func truncate(s string) string {
	const max = 64
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
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
