package otelx

import "go.opentelemetry.io/otel/attribute"

// Instrumentation names of the library's tracers and meter.
const (
	MiddlewareTracer = "github.com/idemkit/watermill-idempotency/middleware"
	OutboxTracer     = "github.com/idemkit/watermill-idempotency/outbox"
	Meter            = "github.com/idemkit/watermill-idempotency/components/idemotel"
)

// Span and metric attributes, next to the messaging semantic conventions;
// docs/observability.md lists them. No payload and no header value other
// than the ids is ever recorded.
const (
	// AttrEventID is the message's event id.
	AttrEventID = attribute.Key("idem.event_id")
	// AttrOutcome is what the middleware did: "processed", "duplicate",
	// "rejected", "stale", "failed" or "claim_error".
	AttrOutcome = attribute.Key("idem.outcome")
	// AttrRejectReason is the reason a message was refused
	// (missing_event_id, invalid_event_id, nil_event_id, not_uuidv7,
	// event_id_mismatch, stale).
	AttrRejectReason = attribute.Key("idem.reject_reason")
	// AttrClaimWait is the time BEGIN and the claim took, in seconds
	// (including the wait for a concurrent claim of the same id).
	AttrClaimWait = attribute.Key("idem.claim_wait")
	// AttrGroupSize is the number of messages of a group commit.
	AttrGroupSize = attribute.Key("idem.group.size")
	// AttrIdempotencyKey is the Idempotency-Key set on a downstream request.
	AttrIdempotencyKey = attribute.Key("idem.idempotency_key")
	// AttrBatchBytes is the payload bytes of a forwarded batch.
	AttrBatchBytes = attribute.Key("idem.outbox.batch.bytes")
	// AttrOutboxLag is how long the batch's oldest message waited in the
	// outbox (from its occurred_at), in seconds.
	AttrOutboxLag = attribute.Key("idem.outbox.lag")
	// AttrForwarder is a forwarder's name (outbox.ForwarderConfig.Name).
	AttrForwarder = attribute.Key("idem.outbox.forwarder.name")
)
