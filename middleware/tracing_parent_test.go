package middleware_test

// Which parent the dedup span takes when a message carries two: a span
// already in msg.Context() and a traceparent in its metadata.

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A span in msg.Context() (one a Watermill-level tracing middleware in
// front of the dedup middleware started) wins over the metadata's
// traceparent; the handler sees the dedup span, and the message's own
// context is restored afterwards.
func TestTracing_ContextSpanWinsOverMetadata(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	tr := newTraced(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TracerProvider = tr.tp })
	var inHandler trace.SpanContext
	h := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		inHandler = trace.SpanContextFromContext(m.Context())
		return nil, nil
	})

	m, _ := tr.producerMsg(t, f, publisher.NewEventID())
	outerCtx, outer := tr.tp.Tracer("router").Start(context.Background(), "router middleware", trace.WithSpanKind(trace.SpanKindConsumer))
	m.SetContext(outerCtx)
	_, err := h(m)
	outer.End()
	require.NoError(t, err)

	s := tr.spans("process")
	require.Len(t, s, 1)
	require.Equal(t, outer.SpanContext().SpanID(), s[0].Parent.SpanID(), "the span in the context is the parent")
	require.False(t, s[0].Parent.IsRemote())
	require.Equal(t, s[0].SpanContext.SpanID(), inHandler.SpanID(), "the handler runs in the dedup span")
	require.Equal(t, outerCtx, m.Context(), "the message's context is restored")
}
