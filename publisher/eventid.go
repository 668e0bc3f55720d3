package publisher

import (
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
)

// Metadata keys written on every outgoing message (Kafka headers).
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
	// PayloadEventIDField is the JSON payload field the consumer falls back to
	// when the event_id header is absent.
	PayloadEventIDField = "eventId"
)

// NewEventID returns a new UUIDv7. Ids from one process are strictly
// increasing (google/uuid keeps a monotonic sub-millisecond counter), so they
// sort by creation time and insert at the right edge of a B-tree.
func NewEventID() uuid.UUID {
	return uuid.Must(uuid.NewV7())
}

// ParseEventID parses a canonical UUID string and checks that it is a
// non-nil UUIDv7. Errors wrap middleware's ErrInvalidEventID, ErrNilEventID or
// ErrNotUUIDv7.
func ParseEventID(s string) (uuid.UUID, error) {
	id, err := eventid.Parse(s)
	if err != nil {
		return uuid.Nil, &eventid.Error{Reason: err, Value: s}
	}
	if err := eventid.Validate(id, false); err != nil {
		return uuid.Nil, &eventid.Error{Reason: err, Value: s}
	}
	return id, nil
}
