// Package publisher holds the event-id contract between producers and the
// dedup middleware: the metadata names, the rules an event id must follow and
// the errors that say which one it broke. It stamps every outgoing event with
// a UUIDv7 event id and the metadata consumers rely on, and reads the id back
// on the consumer side.
//
// An event id is a non-nil UUIDv7 in canonical form (36 characters,
// hyphenated, either case), carried in the metadata key event_id
// ([MetadataEventID], a Kafka header) and, for producers outside this
// library, in the top-level JSON payload field eventId
// ([PayloadEventIDField]). [ParseEventID] parses one string;
// [EventIDFromMessage] reads a message (header and payload must agree when
// both are present), [EventIDFromMetadata] lets the header win (with or
// without the payload as the fallback); [ValidateEventID] checks a
// parsed id. The EventIDFrom* functions are ready-made values for the
// middleware's Config.EventIDFunc. Every refusal is an *[EventIDError] whose Reason is one of [ErrMissingEventID],
// [ErrInvalidEventID], [ErrNilEventID], [ErrNotUUIDv7] or
// [ErrEventIDMismatch]; the middleware's IsPermanent treats them all as
// permanent.
//
// [Stamp] keeps a valid event_id; else copies a UUIDv7 from the payload's
// eventId field; else reuses msg.UUID when it is a UUIDv7; else generates
// one ([NewEventID]). It also writes occurred_at and, inside a handler,
// causation_id and correlation_id. [WithPartitionKey] sets the aggregate id
// that becomes the Kafka record key. docs/rules.md gives the reasons.
//
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	publisher.WithPartitionKey(msg, orderID)
//	id, err := publisher.Stamp(ctx, msg)
//
// [NewStampingPublisher] wraps any message.Publisher so that everything it
// publishes is stamped. The outbox package stamps on its own.
//
// The Kafka client configs (safe producer and consumer settings, the
// record key taken from partition_key) are in package idemkafka.
package publisher
