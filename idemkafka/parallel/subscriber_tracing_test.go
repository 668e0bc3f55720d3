package parallel_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// The dedup middleware's consumer span carries the record's partition and
// offset, which the Subscriber puts in the message context, and its key
// when Config.TraceMessageKey is set (and not otherwise).
func TestSubscriberConsumerSpanCarriesKeyPartitionOffset(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	f := newFixture(t, 1, 2)
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "a", 1), f.event(t, "b", 1)))
	sub := f.subscriber(t, f.config("spans"))
	f.router(t, sub, f.db.Pool, 0, func(c *idem.Config) { c.TracerProvider = tp; c.TraceMessageKey = true }, ledgerHandler(nil))
	f.waitApplied(t, 2)
	waitFor(t, "two consumer spans", func() bool { return len(exp.GetSpans()) >= 2 })
	got := map[string]int{}
	for _, s := range exp.GetSpans() {
		attrs := attribute.NewSet(s.Attributes...)
		key, _ := attrs.Value(semconv.MessagingKafkaMessageKeyKey)
		off, _ := attrs.Value(semconv.MessagingKafkaOffsetKey)
		part, _ := attrs.Value(semconv.MessagingDestinationPartitionIDKey)
		require.Equal(t, "0", part.AsString())
		got[key.AsString()] = int(off.AsInt64())
	}
	require.Equal(t, map[string]int{"a": 0, "b": 1}, got)
}
