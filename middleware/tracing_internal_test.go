package middleware

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// With no TracerProvider configured and no SDK installed globally, the
// middleware makes no span and allocates nothing for tracing.
func TestStartSpanWithoutProviderAllocatesNothing(t *testing.T) {
	d := &Dedup{}
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
