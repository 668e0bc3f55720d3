package publisher_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// BenchmarkStamp is the producer's per-message CPU cost, no I/O: new, a
// message without an event id (a UUIDv7 is generated, occurred_at written);
// in-handler, the same inside a handler wrapped by the dedup middleware (also
// causation_id and correlation_id); stamped, a message stamped before (the
// idempotent path: everything is kept). One message is reused, its metadata
// cleared between iterations.
func BenchmarkStamp(b *testing.B) {
	incoming := uuid.Must(uuid.NewV7())
	for _, bc := range []struct {
		name  string
		ctx   context.Context
		clear bool
	}{
		{"new", context.Background(), true},
		{"in-handler", idemctx.With(context.Background(), &idemctx.Value{EventID: incoming}), true},
		{"stamped", context.Background(), false},
	} {
		b.Run(bc.name, func(b *testing.B) {
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct-1","amountCents":1250}`))
			if _, err := publisher.Stamp(bc.ctx, msg); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if bc.clear {
					clear(msg.Metadata)
				}
				if _, err := publisher.Stamp(bc.ctx, msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
