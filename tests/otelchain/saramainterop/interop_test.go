package saramainterop_test

// These tests change the global TracerProvider and propagator: none of them
// calls t.Parallel, and the package holds nothing else.

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/tests/otelchain"
)

// useGlobal installs e's provider and p as the global ones until the test
// ends (then a no-op propagator; the SDK provider is shut down by e).
func useGlobal(t *testing.T, e *otelchain.Env, p propagation.TextMapPropagator) {
	otel.SetTracerProvider(e.TP)
	otel.SetTextMapPropagator(p)
	t.Cleanup(func() { otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator()) })
}

var w3c = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// saramaTracer is the subscriber option that turns watermill-kafka's Sarama
// tracer on.
func saramaTracer(c *kafka.SubscriberConfig) { c.Tracer = kafka.NewOTELSaramaTracer() }

// global leaves the middleware on the global provider, as with the Sarama
// tracer, which only knows the global one.
func global(c *idem.Config) { c.TracerProvider = nil }

// billing runs the order service once through the forwarder (fwdMod) to
// billing (Sarama tracer on the subscriber, dedup on the global provider)
// and returns the order span and every span once otelsarama's receive
// span, billing's dedup span, the forwarder's batch span and the spans named
// wait have ended (each ends on its own goroutine: a producer span when the
// broker acknowledged, which may come after a consumer fetched the record).
func billing(t *testing.T, e *otelchain.Env, fwdMod func(*outbox.ForwarderConfig), wait ...string) (trace.SpanContext, tracetest.SpanStubs) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e.StartForwarder(t, fwdMod)
	e.StartConsumer(t, otelchain.GroupBilling, e.Orders, e.Charged, e.BillingHandler(e.TP), global, saramaTracer)
	order, err := e.PlaceOrder(ctx, e.TP, "ord-interop")
	require.NoError(t, err)
	var spans tracetest.SpanStubs
	require.Eventually(t, func() bool {
		spans = e.Exp.GetSpans()
		for _, name := range append(wait, e.Orders+" receive", "process "+e.Orders, "send "+e.Orders) {
			if len(otelchain.Named(spans, name)) == 0 {
				return false
			}
		}
		return true
	}, 90*time.Second, 20*time.Millisecond, "billing's dedup span and the batch span")
	return order, spans
}

// Both on, with the global provider and the W3C propagator installed:
// otelsarama's receive span is the producer's child and hands its own
// context on in the record's headers, so the dedup span is the receive
// span's child. One trace: order → receive → process → charge.
func TestSaramaTracer_ConsumerSideOneTrace(t *testing.T) {
	e := otelchain.New(t)
	useGlobal(t, e, w3c)
	order, spans := billing(t, e, func(c *outbox.ForwarderConfig) { c.TracerProvider = nil })

	receive := otelchain.Named(spans, e.Orders+" receive")
	require.Len(t, receive, 1)
	r := receive[0]
	require.Equal(t, trace.SpanKindConsumer, r.SpanKind)
	require.Equal(t, order.TraceID(), r.SpanContext.TraceID(), "otelsarama continues the producer's trace")
	require.Equal(t, order.SpanID(), r.Parent.SpanID(), "otelsarama's consumer span is the producer's child")

	d := otelchain.Named(spans, "process "+e.Orders)[0]
	require.Equal(t, order.TraceID(), d.SpanContext.TraceID(), "one trace, not two")
	require.Equal(t, r.SpanContext.SpanID(), d.Parent.SpanID(), "the dedup span's parent is otelsarama's consumer span")
	require.Equal(t, "processed", otelchain.Attr(d, otelx.AttrOutcome).AsString())
	require.Len(t, otelchain.Named(otelchain.ChildrenOf(spans, d.SpanContext), "POST /charges"), 1)

	// The forwarder's batch span (global provider too) links to the row.
	requireLinked(t, otelchain.Named(spans, "send "+e.Orders), order)
}

// Both on at both ends: the forwarder publishes through a watermill-kafka
// Publisher with the Sarama tracer, whose per-record producer span is the
// row's child and replaces the traceparent header. One trace: order →
// publish → receive → process, and the forwarder's batch span still links
// to the row's context.
func TestSaramaTracer_ProducerAndConsumerSideOneTrace(t *testing.T) {
	e := otelchain.New(t)
	useGlobal(t, e, w3c)
	pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: e.Broker.Addrs})
	require.NoError(t, err)
	pc.Tracer = kafka.NewOTELSaramaTracer()
	pub, err := kafka.NewPublisher(pc, e.Logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	order, spans := billing(t, e, func(c *outbox.ForwarderConfig) {
		c.TracerProvider = nil
		c.Publisher = pub
	}, e.Orders+" publish")

	publish := otelchain.Named(spans, e.Orders+" publish")
	require.Len(t, publish, 1)
	require.Equal(t, trace.SpanKindProducer, publish[0].SpanKind)
	require.Equal(t, order.SpanID(), publish[0].Parent.SpanID(), "otelsarama's producer span is the row's child")
	receive := otelchain.Named(spans, e.Orders+" receive")
	require.Len(t, receive, 1)
	require.Equal(t, publish[0].SpanContext.SpanID(), receive[0].Parent.SpanID())
	d := otelchain.Named(spans, "process "+e.Orders)[0]
	require.Equal(t, receive[0].SpanContext.SpanID(), d.Parent.SpanID())
	for _, s := range []tracetest.SpanStub{publish[0], receive[0], d} {
		require.Equal(t, order.TraceID(), s.SpanContext.TraceID(), "%s: one trace", s.Name)
	}
	requireLinked(t, otelchain.Named(spans, "send "+e.Orders), order)
	t.Logf("the order's trace:\n%s", otelchain.Tree(spans, order.TraceID()))
}

// requireLinked fails unless one of spans links to sc.
func requireLinked(t *testing.T, spans tracetest.SpanStubs, sc trace.SpanContext) {
	t.Helper()
	for _, s := range spans {
		if otelchain.Linked(s, sc) {
			return
		}
	}
	t.Fatalf("no forwarder batch span links to %s", sc.SpanID())
}

// The pitfall: the Sarama tracer on with no global propagator (the OTel
// default is a no-op one). otelsarama then neither reads nor writes the
// headers: its receive span is the root of a trace of its own, detached.
// The dedup span still reads the producer's traceparent from the headers
// and stays in the order's trace, so the business trace is intact, but the
// Sarama span is lost to it. Hence: install the W3C propagator globally
// when you turn the Sarama tracer on (docs/observability.md).
func TestSaramaTracer_WithoutGlobalPropagatorIsDetached(t *testing.T) {
	e := otelchain.New(t)
	useGlobal(t, e, propagation.NewCompositeTextMapPropagator())
	order, spans := billing(t, e, nil)

	r := otelchain.Named(spans, e.Orders+" receive")
	require.Len(t, r, 1)
	require.False(t, r[0].Parent.IsValid(), "otelsarama's span starts a trace of its own")
	require.NotEqual(t, order.TraceID(), r[0].SpanContext.TraceID())
	d := otelchain.Named(spans, "process "+e.Orders)[0]
	require.Equal(t, order.TraceID(), d.SpanContext.TraceID(), "the dedup span stays in the business trace")
	require.Equal(t, order.SpanID(), d.Parent.SpanID())
}
