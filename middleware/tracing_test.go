package middleware_test

// OpenTelemetry: the dedup middleware's consumer span per message, with the
// SDK's in-memory exporter, against a real PostgreSQL schema.

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type traced struct {
	exp *tracetest.InMemoryExporter
	tp  *sdktrace.TracerProvider
}

func newTraced(t *testing.T) *traced {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &traced{exp: exp, tp: tp}
}

func (tr *traced) spans(name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range tr.exp.GetSpans() {
		if s.Name == name || strings.HasPrefix(s.Name, name+" ") {
			out = append(out, s)
		}
	}
	return out
}

func attr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// producerMsg returns a message carrying id and the W3C trace context of a
// producer span, as the outbox forwarder puts it in Kafka headers.
func (tr *traced) producerMsg(t *testing.T, f *ledgerFixture, id uuid.UUID) (*message.Message, trace.SpanContext) {
	ctx, span := tr.tp.Tracer("test").Start(context.Background(), "publish orders", trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	m := f.msg(id)
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(m.Metadata))
	require.NotEmpty(t, m.Metadata.Get("traceparent"))
	return m, span.SpanContext()
}

// A processed message: one consumer span, child of the producer's context,
// with the messaging attributes, the event id, the outcome and the claim;
// the handler's own span nests under it. A redelivery shows as a span with
// outcome "duplicate" and no handler span under it. No attribute carries
// the payload.
func TestTracing_ConsumerSpanPerMessage(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	var calls atomic.Int32
	insert := f.insertHandler(1, &calls)
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		_, span := tr.tp.Tracer("handler").Start(m.Context(), "charge")
		defer span.End()
		return insert(m)
	})

	id := publisher.NewEventID()
	m, producer := tr.producerMsg(t, f, id)
	m.Payload = []byte(`{"secret":"card-4242"}`)
	_, err := h(m)
	require.NoError(t, err)

	dedup := tr.spans("process")
	require.Len(t, dedup, 1)
	s := dedup[0]
	require.Equal(t, trace.SpanKindConsumer, s.SpanKind)
	require.Equal(t, producer.TraceID(), s.SpanContext.TraceID(), "same trace as the producer")
	require.Equal(t, producer.SpanID(), s.Parent.SpanID(), "child of the producer's context")
	require.Equal(t, "processed", attr(s, otelx.AttrOutcome).AsString())
	require.Equal(t, id.String(), attr(s, otelx.AttrEventID).AsString())
	require.Equal(t, "billing", attr(s, "messaging.consumer.group.name").AsString())
	require.Equal(t, "process", attr(s, "messaging.operation.name").AsString())
	require.Equal(t, "claim", s.Events[0].Name)
	for _, kv := range s.Attributes {
		require.NotContains(t, kv.Value.String(), "card-4242", "no payload in attributes")
	}
	charge := tr.spans("charge")
	require.Len(t, charge, 1)
	require.Equal(t, s.SpanContext.SpanID(), charge[0].Parent.SpanID(), "the handler's span nests under the dedup span")

	tr.exp.Reset()
	m, _ = tr.producerMsg(t, f, id)
	_, err = h(m)
	require.NoError(t, err)
	dup := tr.spans("process")
	require.Len(t, dup, 1)
	require.Equal(t, "duplicate", attr(dup[0], otelx.AttrOutcome).AsString())
	require.Empty(t, tr.spans("charge"), "the handler did not run")
	require.EqualValues(t, 1, calls.Load())
}

// Refused and failed messages record their outcome (and the refusal's
// reason) with an error status.
func TestTracing_RejectedAndFailedOutcomes(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	boom := errors.New("downstream down")
	h := d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, boom })

	bad := message.NewMessage(uuid.NewString(), []byte(`{}`))
	bad.Metadata.Set(publisher.MetadataEventID, uuid.NewString()) // a v4
	_, err := h(bad)
	require.ErrorIs(t, err, publisher.ErrNotUUIDv7)
	_, err = h(f.msg(publisher.NewEventID()))
	require.ErrorIs(t, err, boom)

	spans := tr.spans("process")
	require.Len(t, spans, 2)
	require.Equal(t, "rejected", attr(spans[0], otelx.AttrOutcome).AsString())
	require.Equal(t, "not_uuidv7", attr(spans[0], otelx.AttrRejectReason).AsString())
	require.Equal(t, "failed", attr(spans[1], otelx.AttrOutcome).AsString())
	require.Equal(t, "Error", spans[1].Status.Code.String())
}

// A panicking handler still ends its span (outcome failed), and the panic
// keeps its value on the way up.
func TestTracing_PanicEndsTheSpan(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	h := d.Middleware(func(*message.Message) ([]*message.Message, error) { panic("handler bug") })
	require.PanicsWithValue(t, "handler bug", func() { _, _ = h(f.msg(publisher.NewEventID())) })
	spans := tr.spans("process")
	require.Len(t, spans, 1)
	require.Equal(t, "failed", attr(spans[0], otelx.AttrOutcome).AsString())
}

// In group commit each message keeps its span, and the group has a span of
// its own linked to them.
func TestTracing_GroupSpanLinksItsMessages(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) {
		c.TracerProvider = tr.tp
		c.Mode = &idem.GroupCommitConfig{MaxMessages: 5, MaxWait: 100 * time.Millisecond, Concurrency: 1}
	})
	var calls atomic.Int32
	for _, err := range deliverAll(d.Middleware(f.insertHandler(1, &calls)), f.msgs(newIDs(5))) {
		require.NoError(t, err)
	}
	msgSpans := tr.spans("process")
	require.Len(t, msgSpans, 5)
	groups := tr.spans("group commit")
	require.NotEmpty(t, groups)
	linked := map[trace.SpanID]bool{}
	for _, g := range groups {
		for _, l := range g.Links {
			linked[l.SpanContext.SpanID()] = true
		}
	}
	for _, s := range msgSpans {
		require.True(t, linked[s.SpanContext.SpanID()], "every message span is linked from its group")
		require.Equal(t, "processed", attr(s, otelx.AttrOutcome).AsString())
	}
}

// The Idempotency-Key transport puts the key (never the body) on the span of
// the call.
func TestTracing_IdempotencyKeyAttribute(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	srv := newKeyServer(t)
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(srv.Client().Transport, "charge")}
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		req, err := http.NewRequestWithContext(m.Context(), http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		return nil, resp.Body.Close()
	})
	_, err := h(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	spans := tr.spans("process")
	require.Len(t, spans, 1)
	require.Equal(t, srv.Keys()[0], attr(spans[0], otelx.AttrIdempotencyKey).AsString())
}

// Without an outbox, the messages a handler returns go to the router's
// publisher carrying the handler's trace (traceparent), so the next
// consumer continues it.
func TestTracing_ReturnedMessagesCarryTheTrace(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	h := d.Middleware(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte("next"))}, nil
	})
	out, err := h(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	require.Len(t, out, 1)
	spans := tr.spans("process")
	require.Len(t, spans, 1)
	require.Contains(t, out[0].Metadata.Get("traceparent"), spans[0].SpanContext.SpanID().String())
}
