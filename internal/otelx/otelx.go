// Package otelx holds what the middleware and the outbox share for
// OpenTelemetry: how a trace travels in message metadata, and when there is
// a tracer to use at all.
package otelx

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Propagator is the W3C TraceContext and Baggage propagator: the trace
// travels in message metadata (Kafka headers) as traceparent, tracestate
// and baggage.
var Propagator propagation.TextMapPropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// unsetGlobal is the global TracerProvider before any SDK is installed (a
// delegating no-op). While otel.GetTracerProvider() still returns it there
// is nothing to record, so no span is made and nothing is allocated.
var unsetGlobal = otel.GetTracerProvider()

// Tracers resolves the tracer of one component: its configured provider,
// or else the global one once an SDK is installed there.
type Tracers struct {
	// Configured is the component's TracerProvider; nil means the global.
	Configured trace.TracerProvider
	// Name is the instrumentation name.
	Name   string
	cached atomic.Pointer[cached]
}

type cached struct {
	tp     trace.TracerProvider
	tracer trace.Tracer
}

// Tracer returns the tracer to use, or nil when there is none (no
// allocation then).
func (t *Tracers) Tracer() trace.Tracer {
	tp := t.Configured
	if tp == nil {
		tp = otel.GetTracerProvider()
		if tp == unsetGlobal {
			return nil
		}
	}
	if c := t.cached.Load(); c != nil && c.tp == tp {
		return c.tracer
	}
	c := &cached{tp: tp, tracer: tp.Tracer(t.Name)}
	t.cached.Store(c)
	return c.tracer
}

// Inject writes ctx's trace context into msg's metadata, unless ctx carries
// no valid span or the metadata already has a traceparent (the trace the
// message was created in wins). It allocates nothing when there is no span.
func Inject(ctx context.Context, msg *message.Message) {
	if !trace.SpanContextFromContext(ctx).IsValid() || msg.Metadata.Get("traceparent") != "" {
		return
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	Propagator.Inject(ctx, propagation.MapCarrier(msg.Metadata))
}

// Extract returns the span context stored in msg's metadata (invalid when
// there is none).
func Extract(msg *message.Message) trace.SpanContext {
	if msg.Metadata.Get("traceparent") == "" {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(Propagator.Extract(context.Background(), propagation.MapCarrier(msg.Metadata)))
}
