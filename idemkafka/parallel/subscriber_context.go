package parallel

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/internal/kafkactx"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// The Subscriber's messages carry the same context values as
// watermill-kafka's, so kafka.MessagePartitionFromCtx,
// kafka.MessagePartitionOffsetFromCtx, kafka.MessageTimestampFromCtx and
// kafka.MessageKeyFromCtx (which the retry topics and the dedup
// middleware's tracing read) work on them (internal/kafkactx).

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

// errSlot holds the error an attempt of a message failed with, for the
// Subscriber's stall reports.
type errSlot struct{ err atomic.Pointer[error] }

func (s *errSlot) get() error {
	if s == nil {
		return nil
	}
	if p := s.err.Load(); p != nil {
		return *p
	}
	return nil
}

type errSlotKey struct{}

// RecordErrors is a router middleware that tells the [Subscriber] the
// error a handler returned before its message is nacked, so that a key
// stalled on failures is reported with its last error
// ([SubscriberStats].Stalls, and the log line). Add it first
// (router.AddMiddleware(parallel.RecordErrors) before the others), or
// anywhere outside the middleware that turns errors into acks (a poison
// queue). On messages of other subscribers it only passes them on.
func RecordErrors(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		slot, _ := msg.Context().Value(errSlotKey{}).(*errSlot)
		msgs, err := h(msg)
		if err != nil && slot != nil {
			slot.err.Store(&err)
		}
		return msgs, err
	}
}

// messageContext is parent with the record's partition, offset, timestamp
// and key, as watermill-kafka sets them, the Subscriber's ordering, and
// the attempt's error slot: one context (recordContext) answering the six
// keys, rather than six nested context.WithValue and their boxed values.
func messageContext(parent context.Context, m *sarama.ConsumerMessage, ordering Ordering, slot *errSlot) context.Context {
	return &recordContext{Context: parent, m: m, ordering: ordering, slot: slot}
}

// recordContext answers the keys of messageContext and passes every other
// key, and everything else, to its parent. Like context.WithValue's, its
// keys shadow the parent's.
type recordContext struct {
	context.Context
	m        *sarama.ConsumerMessage
	ordering Ordering
	slot     *errSlot
}

func (c *recordContext) Value(key any) any {
	switch key {
	case orderingKey{}:
		return c.ordering
	case progresssql.SubscriberKey{}:
		return true // the Subscriber keeps its progress itself
	case errSlotKey{}:
		return c.slot
	}
	if v, ok := (kafkactx.Record{Partition: c.m.Partition, Offset: c.m.Offset, Timestamp: c.m.Timestamp, Key: c.m.Key}).Value(key); ok {
		return v
	}
	return c.Context.Value(key)
}

// String names the context as context.WithValue's do, for debugging.
func (c *recordContext) String() string {
	return fmt.Sprintf("%v.WithRecord(%s/%d@%d)", c.Context, c.m.Topic, c.m.Partition, c.m.Offset)
}
