package middleware

import (
	"context"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
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

// start begins the consumer span of msg. Its parent is the span already in
// msg.Context() (watermill-kafka's Sarama tracer puts one there), or else the
// trace context the producer left in the metadata (traceparent, tracestate,
// baggage). It returns nil when tracing is off.
func (d *Dedup) startSpan(msg *message.Message) (context.Context, *msgSpan) {
	tr := d.tracing.Tracer()
	if tr == nil {
		return msg.Context(), nil
	}
	return d.startSpanOn(tr, msg)
}

// startSpanOn is startSpan with tracer tr. It is apart so that, with
// tracing off, startSpan's stack frame stays small: the router runs each
// message in a new goroutine, whose small stack would otherwise be grown
// (copied) for this frame alone while the message waits for its group.
func (d *Dedup) startSpanOn(tr trace.Tracer, msg *message.Message) (context.Context, *msgSpan) {
	ctx := msg.Context()
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = otelx.Propagator.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	}
	topic := message.SubscribeTopicFromCtx(msg.Context())
	name := "process"
	if topic != "" {
		name += " " + topic
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingConsumerGroupName(d.cfg.ConsumerGroup),
		semconv.MessagingMessageID(msg.UUID),
	}
	ctx, span := tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(append(attrs, kafkaAttributes(msg.Context(), d.cfg.TraceMessageKey)...)...))
	return ctx, &msgSpan{span: span}
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
