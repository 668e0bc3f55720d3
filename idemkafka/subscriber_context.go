package idemkafka

import (
	"context"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
)

// The Subscriber's messages carry the same context values as
// watermill-kafka's, so kafka.MessagePartitionFromCtx,
// kafka.MessagePartitionOffsetFromCtx, kafka.MessageTimestampFromCtx and
// kafka.MessageKeyFromCtx (which the retry topics and the dedup
// middleware's tracing read) work on them. watermill-kafka does not export
// its context keys: each is learnt once by asking its accessor, through a
// context that records the key it is asked for.
var (
	ctxKeyPartition = keyOf(func(ctx context.Context) { kafka.MessagePartitionFromCtx(ctx) })
	ctxKeyOffset    = keyOf(func(ctx context.Context) { kafka.MessagePartitionOffsetFromCtx(ctx) })
	ctxKeyTimestamp = keyOf(func(ctx context.Context) { kafka.MessageTimestampFromCtx(ctx) })
	ctxKeyKey       = keyOf(func(ctx context.Context) { kafka.MessageKeyFromCtx(ctx) })
)

// keyProbe is a context that records the key of its last Value call.
type keyProbe struct {
	context.Context
	key any
}

func (p *keyProbe) Value(key any) any {
	p.key = key
	return nil
}

func keyOf(accessor func(context.Context)) any {
	p := &keyProbe{Context: context.Background()}
	accessor(p)
	return p.key
}

// orderingKey is the context key of the Subscriber's [Ordering].
type orderingKey struct{}

// OrderingFromContext returns the [Ordering] of the [Subscriber] that
// handed out the message whose context ctx is; false for a message of
// another subscriber. Middleware that relies on the order of a key's
// messages (retrytopic's KeyOrder) reads it to refuse OrderNone.
func OrderingFromContext(ctx context.Context) (Ordering, bool) {
	o, ok := ctx.Value(orderingKey{}).(Ordering)
	return o, ok
}

// messageContext is parent with the record's partition, offset, timestamp
// and key, as watermill-kafka sets them, and the Subscriber's ordering.
func messageContext(parent context.Context, m *sarama.ConsumerMessage, ordering Ordering) context.Context {
	ctx := context.WithValue(parent, orderingKey{}, ordering)
	ctx = context.WithValue(ctx, ctxKeyPartition, m.Partition)
	ctx = context.WithValue(ctx, ctxKeyOffset, m.Offset)
	ctx = context.WithValue(ctx, ctxKeyTimestamp, m.Timestamp)
	return context.WithValue(ctx, ctxKeyKey, m.Key)
}
