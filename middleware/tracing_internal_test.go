package middleware

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// With no TracerProvider configured and no SDK installed globally, the
// middleware makes no span and allocates nothing for tracing.
func TestStartSpanWithoutProviderAllocatesNothing(t *testing.T) {
	d := &Dedup{tracing: &otelx.Tracers{}}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	allocs := testing.AllocsPerRun(100, func() {
		if _, span := d.startSpan(msg); span != nil {
			t.Fatal("a span without a provider")
		}
	})
	if allocs != 0 {
		t.Fatalf("startSpan allocated %v times per message without a provider", allocs)
	}
}

// BenchmarkSpan is the tracing work of one processed message, without the
// database: the span the middleware makes (parent from the metadata's
// traceparent), its event id, claim and commit events and outcome, ended
// into an SDK TracerProvider whose exporter drops it. make bench measures
// the same against the whole message path (section dedup-tracing).
func BenchmarkSpan(b *testing.B) {
	for _, p := range []struct {
		name string
		opt  sdktrace.TracerProviderOption
	}{
		{"batch", sdktrace.WithBatcher(tracetest.NewNoopExporter())},
		{"simple", sdktrace.WithSpanProcessor(sdktrace.NewSimpleSpanProcessor(tracetest.NewNoopExporter()))},
	} {
		b.Run(p.name, func(b *testing.B) {
			tp := sdktrace.NewTracerProvider(p.opt)
			defer func() { _ = tp.Shutdown(context.Background()) }()
			d := &Dedup{cfg: Config{ConsumerGroup: "bench"}, tracing: &otelx.Tracers{Configured: tp, Name: otelx.MiddlewareTracer}}
			id := uuid.Must(uuid.NewV7())
			msg := message.NewMessage(id.String(), nil)
			msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
			b.ReportAllocs()
			for b.Loop() {
				_, span := d.startSpan(msg)
				span.eventID(id)
				span.claimed(time.Millisecond, true)
				span.event("commit")
				span.end(outcomeProcessed, nil)
			}
		})
	}
}
