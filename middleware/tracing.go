package middleware

import (
	"context"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// Outcomes recorded in otelx.AttrOutcome.
const (
	outcomeProcessed  = "processed"
	outcomeDuplicate  = "duplicate"
	outcomeRejected   = "rejected"
	outcomeStale      = "stale"
	outcomeFailed     = "failed"
	outcomeClaimError = "claim_error"
	outcomeLeaseBusy  = "lease_busy"
	outcomeLeaseLost  = "lease_lost"
)

// msgSpan is the consumer span of one message; a nil *msgSpan does nothing.
type msgSpan struct {
	span trace.Span
}

// kafkaAttributes are the record's partition, offset and (withKey) key,
// from the context values watermill-kafka's subscriber and idemkafka's set.
func kafkaAttributes(ctx context.Context, withKey bool) []attribute.KeyValue {
	var attrs []attribute.KeyValue
	if p, ok := kafka.MessagePartitionFromCtx(ctx); ok {
		attrs = append(attrs, semconv.MessagingDestinationPartitionID(strconv.FormatInt(int64(p), 10)))
	}
	if off, ok := kafka.MessagePartitionOffsetFromCtx(ctx); ok {
		attrs = append(attrs, semconv.MessagingKafkaOffset(int(off)))
	}
	if key, ok := kafka.MessageKeyFromCtx(ctx); withKey && ok && len(key) > 0 {
		attrs = append(attrs, semconv.MessagingKafkaMessageKey(string(key)))
	}
	return attrs
}

func (s *msgSpan) eventID(id uuid.UUID) {
	if s != nil {
		s.span.SetAttributes(otelx.AttrEventID.String(id.String()))
	}
}

func (s *msgSpan) claimed(wait time.Duration, first bool) {
	if s != nil {
		s.span.AddEvent("claim", trace.WithAttributes(otelx.AttrClaimWait.Float64(wait.Seconds()), attribute.Bool("idem.first", first)))
	}
}

func (s *msgSpan) event(name string) {
	if s != nil {
		s.span.AddEvent(name)
	}
}

// end records the outcome and ends the span.
func (s *msgSpan) end(outcome string, err error) {
	if s == nil {
		return
	}
	s.span.SetAttributes(otelx.AttrOutcome.String(outcome))
	switch outcome {
	case outcomeRejected, outcomeStale:
		if reason := rejectReason(err); reason != "" {
			s.span.SetAttributes(otelx.AttrRejectReason.String(reason))
		}
		s.span.SetStatus(codes.Error, "refused")
	case outcomeFailed, outcomeClaimError, outcomeLeaseBusy, outcomeLeaseLost:
		s.span.RecordError(err)
		s.span.SetStatus(codes.Error, err.Error())
	}
	s.span.End()
}
