package spantree

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/instrumentation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

func TestTree(t *testing.T) {
	t.Parallel()
	tid, other := trace.TraceID{1}, trace.TraceID{2}
	sc := func(tid trace.TraceID, sid byte) trace.SpanContext {
		return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: trace.SpanID{sid}, TraceFlags: trace.FlagsSampled})
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	span := func(name string, self, parent trace.SpanContext, startMs, durUs int, service string, attrs ...attribute.KeyValue) tracetest.SpanStub {
		s := tracetest.SpanStub{
			Name: name, SpanContext: self, Parent: parent, Attributes: attrs,
			StartTime:            t0.Add(time.Duration(startMs) * time.Millisecond),
			InstrumentationScope: instrumentation.Scope{Name: "github.com/idemkit/watermill-idempotency/middleware"},
			// The SDK's default resource names no service of its own.
			Resource: resource.NewSchemaless(attribute.String("service.name", "unknown_service:spantree.test")),
		}
		s.EndTime = s.StartTime.Add(time.Duration(durUs) * time.Microsecond)
		if service != "" {
			s.Resource = resource.NewSchemaless(attribute.String("service.name", service))
		}
		return s
	}
	root := span("confirm order", sc(tid, 1), trace.SpanContext{}, 0, 1500, "order-service")
	later := span("process orders", sc(tid, 2), root.SpanContext, 5, 2000, "", otelx.AttrOutcome.String("duplicate"))
	first := span("process orders", sc(tid, 3), root.SpanContext, 2, 2840, "billing",
		otelx.AttrOutcome.String("processed"), otelx.AttrIdempotencyKey.String("k-1"))
	grandchild := span("POST /charges", sc(tid, 4), first.SpanContext, 3, 600, "billing")
	batch := span("send orders", sc(other, 5), trace.SpanContext{}, 1, 250, "a-much-longer-service-name")
	batch.Links = []sdktrace.Link{{SpanContext: root.SpanContext}}
	unrelated := span("send elsewhere", sc(other, 6), trace.SpanContext{}, 1, 250, "outbox")
	orphan := span("process late", sc(tid, 7), sc(tid, 99), 9, 100, "notification")

	got := Tree(tracetest.SpanStubs{later, grandchild, first, batch, unrelated, orphan, root}, tid)
	want := "" +
		"confirm order                                    order-service                 1.5ms\n" +
		"  linked: send orders                            a-much-longer-service-name    250µs\n" +
		"  process orders                                 billing                      2.84ms outcome=processed idempotency_key=k-1\n" +
		"    POST /charges                                billing                       600µs\n" +
		"  process orders                                 middleware                      2ms outcome=duplicate\n" +
		"process late                                     notification                  100µs\n"
	require.Equal(t, want, got)
	require.Empty(t, Tree(tracetest.SpanStubs{unrelated}, tid))
}
