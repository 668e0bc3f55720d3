package otelchain_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/publisher"
	"github.com/idemkit/watermill-idempotency/tests/otelchain"
)

func orderID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "ord-" + hex.EncodeToString(b[:])
}

// waitSpans waits until the exporter holds a span named name that pred
// accepts, and returns all spans.
func waitSpans(t *testing.T, e *otelchain.Env, name string, pred func(tracetest.SpanStub) bool) tracetest.SpanStubs {
	t.Helper()
	var spans tracetest.SpanStubs
	require.Eventually(t, func() bool {
		spans = e.Exp.GetSpans()
		for _, s := range otelchain.Named(spans, name) {
			if pred(s) {
				return true
			}
		}
		return false
	}, 90*time.Second, 20*time.Millisecond, "a span %q", name)
	return spans
}

func anySpan(tracetest.SpanStub) bool { return true }

// linkedTo returns the spans that link to sc.
func linkedTo(spans tracetest.SpanStubs, sc trace.SpanContext) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if otelchain.Linked(s, sc) {
			out = append(out, s)
		}
	}
	return out
}

// One trace across the billing chain, with the explicit TracerProvider of
// every component (Config.TracerProvider, ForwarderConfig.TracerProvider):
//
//  1. the order service's business transaction (BEGIN, INSERT, outbox
//     write, COMMIT) is the root span;
//  2. the outbox row takes its context and the forwarder carries it to
//     Kafka: the record's traceparent header is the order span, and the
//     forwarder's batch span links to it (a batch has many parents);
//  3. billing's dedup span is a child of that producer context, with the
//     event id, the group and outcome processed; the charge's client span
//     nests under it and records the Idempotency-Key the provider received;
//  4. billing.charged.v1, returned by the handler, goes through the outbox
//     (Config.Outbox) and the forwarder with billing's dedup span as its
//     traceparent (and the batch span links to it);
//  5. the notification consumer's dedup span is in the same trace, a child
//     of billing's;
//  6. the same record delivered again is a span with outcome duplicate, in
//     the same trace, with no child span (the handler did not run) and no
//     second charge.
//
// No attribute anywhere carries payload bytes or a header value other than
// the ids; the baggage of the order request reaches both consumers.
func TestTrace_BillingChainIsOneTrace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e := otelchain.New(t)
	fwd := e.StartForwarder(t, nil)
	billing := e.StartConsumer(t, otelchain.GroupBilling, e.Orders, e.Charged, e.BillingHandler(e.TP), nil, nil)
	e.StartConsumer(t, otelchain.GroupNotification, e.Charged, e.Charged, otelchain.NotificationHandler, nil, nil)

	order, err := e.PlaceOrder(ctx, e.TP, orderID())
	require.NoError(t, err)
	traceID := order.TraceID()
	require.Eventually(t, func() bool { return e.DB.Count(t, "SELECT 1 FROM notifications") == 1 },
		90*time.Second, 20*time.Millisecond, "the notification consumer applied billing.charged.v1")
	// Every span of the chain has ended (a batch span ends when the broker
	// acknowledged, which may come after a consumer fetched the record).
	var spans tracetest.SpanStubs
	require.Eventually(t, func() bool {
		spans = e.Exp.GetSpans()
		return len(otelchain.Named(spans, "process "+e.Charged)) == 1 &&
			len(otelchain.Named(spans, "send "+e.Orders)) > 0 && len(otelchain.Named(spans, "send "+e.Charged)) > 0
	}, 90*time.Second, 20*time.Millisecond, "the chain's spans")
	orderRecs := e.Records(t, e.Orders, 1)
	chargedRecs := e.Records(t, e.Charged, 1)
	var b tracetest.SpanStub // billing's dedup span

	t.Run("1 the business transaction starts the trace", func(t *testing.T) {
		root := otelchain.Named(spans, "confirm order")
		require.Len(t, root, 1)
		require.False(t, root[0].Parent.IsValid(), "a root span")
		require.Equal(t, order, root[0].SpanContext)
	})

	t.Run("2 the outbox row takes it and the forwarder carries it to Kafka", func(t *testing.T) {
		require.Equal(t, otelchain.Traceparent(order), otelchain.Header(orderRecs[0], "traceparent"), "the record's traceparent is the business transaction's span")
		require.Equal(t, otelchain.BaggageMember, otelchain.Header(orderRecs[0], "baggage"))
		send := linkedTo(otelchain.Named(spans, "send "+e.Orders), order)
		require.NotEmpty(t, send, "the forwarder's batch span links to the row's context")
		require.False(t, send[0].Parent.IsValid(), "a batch span has many parents: links, no parent")
		require.Equal(t, trace.SpanKindProducer, send[0].SpanKind)
		require.EqualValues(t, 1, otelchain.Attr(send[0], "messaging.batch.message_count").AsInt64())
		require.Equal(t, e.Orders, otelchain.Attr(send[0], "messaging.destination.name").AsString())
	})

	t.Run("3 billing's dedup span is a child of the producer's context and charges with the key", func(t *testing.T) {
		bill := otelchain.Named(spans, "process "+e.Orders)
		require.Len(t, bill, 1)
		b = bill[0]
		require.Equal(t, trace.SpanKindConsumer, b.SpanKind)
		require.Equal(t, traceID, b.SpanContext.TraceID(), "billing is in the order's trace")
		require.Equal(t, order.SpanID(), b.Parent.SpanID(), "billing's dedup span is a child of the producer's context")
		require.True(t, b.Parent.IsRemote())
		require.Equal(t, "processed", otelchain.Attr(b, otelx.AttrOutcome).AsString())
		require.Equal(t, otelchain.GroupBilling, otelchain.Attr(b, "messaging.consumer.group.name").AsString())
		require.Equal(t, otelchain.Header(orderRecs[0], publisher.MetadataEventID), otelchain.Attr(b, otelx.AttrEventID).AsString())
		require.Equal(t, []string{"claim", "commit"}, []string{b.Events[0].Name, b.Events[1].Name})
		charge := otelchain.Named(otelchain.ChildrenOf(spans, b.SpanContext), "POST /charges")
		require.Len(t, charge, 1, "the charge call nests under the dedup span")
		require.Len(t, otelchain.Named(spans, "POST /charges"), 1)
		require.Equal(t, e.Provider.Keys(), []string{otelchain.Attr(charge[0], otelx.AttrIdempotencyKey).AsString()},
			"the charge's span records the Idempotency-Key the provider received")
	})

	t.Run("4 billing.charged.v1 goes through the outbox and the forwarder", func(t *testing.T) {
		require.Equal(t, otelchain.Traceparent(b.SpanContext), otelchain.Header(chargedRecs[0], "traceparent"),
			"the row billing's handler returned (Config.Outbox) carries billing's dedup span")
		require.Equal(t, otelchain.BaggageMember, otelchain.Header(chargedRecs[0], "baggage"), "baggage crosses the second hop")
		require.NotEmpty(t, linkedTo(otelchain.Named(spans, "send "+e.Charged), b.SpanContext), "a batch span links to billing's dedup span")
	})

	t.Run("5 the notification's dedup span is in the same trace", func(t *testing.T) {
		notif := otelchain.Named(spans, "process "+e.Charged)
		require.Len(t, notif, 1)
		require.Equal(t, traceID, notif[0].SpanContext.TraceID(), "the last consumer is in the order's trace")
		require.Equal(t, b.SpanContext.SpanID(), notif[0].Parent.SpanID())
		require.Equal(t, otelchain.GroupNotification, otelchain.Attr(notif[0], "messaging.consumer.group.name").AsString())
		require.Equal(t, "processed", otelchain.Attr(notif[0], otelx.AttrOutcome).AsString())
		// Every span but the forwarder's batch spans (roots of their own,
		// linked) is in the one trace.
		for _, s := range spans {
			if s.SpanKind == trace.SpanKindProducer && s.InstrumentationScope.Name == otelx.OutboxTracer {
				continue
			}
			require.Equal(t, traceID, s.SpanContext.TraceID(), "span %q", s.Name)
		}
	})

	t.Run("6 a duplicate delivery is a span with outcome duplicate and no handler span", func(t *testing.T) {
		e.Republish(t, orderRecs[0])
		dupOf := func(s tracetest.SpanStub) bool { return otelchain.Attr(s, otelx.AttrOutcome).AsString() == "duplicate" }
		spans = waitSpans(t, e, "process "+e.Orders, dupOf)
		var dup tracetest.SpanStubs
		for _, s := range otelchain.Named(spans, "process "+e.Orders) {
			if dupOf(s) {
				dup = append(dup, s)
			}
		}
		require.Len(t, dup, 1)
		require.Equal(t, traceID, dup[0].SpanContext.TraceID())
		require.Equal(t, order.SpanID(), dup[0].Parent.SpanID())
		require.Equal(t, otelchain.Attr(b, otelx.AttrEventID), otelchain.Attr(dup[0], otelx.AttrEventID))
		require.Empty(t, otelchain.ChildrenOf(spans, dup[0].SpanContext), "the handler did not run: no child span")
		require.Equal(t, "claim", dup[0].Events[0].Name)
		require.Len(t, dup[0].Events, 1, "no commit")
		require.Len(t, otelchain.Named(spans, "POST /charges"), 1)
		require.Equal(t, 1, e.Provider.Requests(), "charged once")
		require.Equal(t, 1, e.DB.Count(t, "SELECT 1 FROM ledger"))
		require.EqualValues(t, 1, billing.Stats().Duplicates)
		require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 2 }, 60*time.Second, 20*time.Millisecond)
		require.Equal(t, 1, e.DB.Count(t, "SELECT 1 FROM "+e.Outbox.MessagesTable(e.Charged)), "nothing more went through the outbox")
	})

	t.Run("no payload or non-id header value in any attribute", func(t *testing.T) {
		otelchain.AssertNothingLeaks(t, e.Exp.GetSpans(), append(orderRecs, chargedRecs...)...)
	})
	t.Logf("the order's trace:\n%s", otelchain.Tree(e.Exp.GetSpans(), traceID))
}

// A traceparent written by a non-Go producer is continued: the header built
// by hand exactly as the W3C Trace Context spec's example and kafkajs's
// OpenTelemetry instrumentation write it (lower-case keys traceparent and
// tracestate, string values, version 00, sampled flag 01).
func TestTrace_NonGoTraceparentIsContinued(t *testing.T) {
	t.Parallel()
	e := otelchain.New(t)
	e.StartForwarder(t, nil)
	e.StartConsumer(t, otelchain.GroupBilling, e.Orders, e.Charged, e.BillingHandler(e.TP), nil, nil)

	const (
		traceID = "0af7651916cd43dd8448eb211c80319c"
		spanID  = "b7ad6b7169203331"
		state   = "congo=t61rcWkgMzE"
	)
	p, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: e.Broker.Addrs})
	require.NoError(t, err)
	defer p.Close()
	id := publisher.NewEventID().String()
	_, _, err = p.SendMessage(&sarama.ProducerMessage{
		Topic: e.Orders, Key: sarama.StringEncoder("ord-js"),
		Value: sarama.StringEncoder(`{"orderId":"ord-js","customerId":"c-js","amount":"1.00"}`),
		Headers: []sarama.RecordHeader{
			{Key: []byte("traceparent"), Value: []byte("00-" + traceID + "-" + spanID + "-01")},
			{Key: []byte("tracestate"), Value: []byte(state)},
			{Key: []byte(publisher.MetadataEventID), Value: []byte(id)},
		},
	})
	require.NoError(t, err)

	spans := waitSpans(t, e, "process "+e.Orders, anySpan)
	b := otelchain.Named(spans, "process "+e.Orders)[0]
	require.Equal(t, traceID, b.SpanContext.TraceID().String(), "the non-Go producer's trace is continued")
	require.Equal(t, spanID, b.Parent.SpanID().String())
	require.True(t, b.Parent.IsRemote())
	require.Equal(t, state, b.SpanContext.TraceState().String(), "tracestate kept")
	require.Equal(t, id, otelchain.Attr(b, otelx.AttrEventID).AsString())

	// ...and handed on: billing.charged.v1 carries the same trace and state.
	charged := e.Records(t, e.Charged, 1)[0]
	require.Equal(t, "00-"+traceID+"-"+b.SpanContext.SpanID().String()+"-01", otelchain.Header(charged, "traceparent"))
	require.Equal(t, state, otelchain.Header(charged, "tracestate"))
}

// recorder is a testing.TB that records Errorf calls.
type recorder struct {
	testing.TB
	errors []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// The leak check itself catches a payload fragment, a non-id header value
// and baggage, in span, event and link attributes, and lets ids through.
func TestAssertNothingLeaksCatchesPayloadAndHeaders(t *testing.T) {
	t.Parallel()
	rec := &sarama.ConsumerMessage{Value: []byte(`{"x":1}`), Headers: []*sarama.RecordHeader{
		{Key: []byte("partition_key"), Value: []byte("ord-secret-key")},
		{Key: []byte(publisher.MetadataEventID), Value: []byte("0190e8b5-0000-7000-8000-000000000001")},
	}}
	ok := tracetest.SpanStub{Name: "ok", Attributes: []attribute.KeyValue{otelx.AttrEventID.String("0190e8b5-0000-7000-8000-000000000001")}}
	r := &recorder{TB: t}
	otelchain.AssertNothingLeaks(r, tracetest.SpanStubs{ok}, rec)
	require.Empty(t, r.errors, "ids are allowed")

	bad := tracetest.SpanStub{
		Name:       "bad",
		Attributes: []attribute.KeyValue{attribute.String("a", "card: "+otelchain.Secret)},
		Events:     []sdktrace.Event{{Name: "e", Attributes: []attribute.KeyValue{attribute.String("b", "ord-secret-key")}}},
		Links:      []sdktrace.Link{{Attributes: []attribute.KeyValue{attribute.String("c", `body {"x":1}`)}}},
	}
	bag := tracetest.SpanStub{Name: "bag", Attributes: []attribute.KeyValue{attribute.String("d", otelchain.BaggageMember)}}
	r = &recorder{TB: t}
	otelchain.AssertNothingLeaks(r, tracetest.SpanStubs{bad, bag}, rec)
	require.Len(t, r.errors, 4)
}
