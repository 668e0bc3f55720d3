package kafkactx_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/internal/kafkactx"
)

// recordCtx answers the record's keys as the subscribers' contexts do.
type recordCtx struct {
	context.Context
	r kafkactx.Record
}

func (c recordCtx) Value(key any) any {
	if v, ok := c.r.Value(key); ok {
		return v
	}
	return c.Context.Value(key)
}

type otherKey struct{}

// watermill-kafka's accessors read a record's values from a context that
// answers with Record.Value, and other keys pass on.
func TestAccessorsRead(t *testing.T) {
	ts := time.Unix(1700000000, 0)
	parent := context.WithValue(context.Background(), otherKey{}, "kept")
	ctx := recordCtx{Context: parent, r: kafkactx.Record{Partition: 3, Offset: 42, Timestamp: ts, Key: []byte("k")}}
	if p, ok := kafka.MessagePartitionFromCtx(ctx); !ok || p != 3 {
		t.Fatalf("partition %d %v", p, ok)
	}
	if o, ok := kafka.MessagePartitionOffsetFromCtx(ctx); !ok || o != 42 {
		t.Fatalf("offset %d %v", o, ok)
	}
	if got, ok := kafka.MessageTimestampFromCtx(ctx); !ok || !got.Equal(ts) {
		t.Fatalf("timestamp %v %v", got, ok)
	}
	if k, ok := kafka.MessageKeyFromCtx(ctx); !ok || string(k) != "k" {
		t.Fatalf("key %q %v", k, ok)
	}
	if ctx.Value(otherKey{}) != "kept" {
		t.Fatal("another key did not pass on")
	}
	if _, ok := kafka.MessagePartitionFromCtx(context.Background()); ok {
		t.Fatal("a context without a record has a partition")
	}
}
