package parallel

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
)

type parentKey struct{}

// messageContext answers what the six context.WithValue it replaces
// answered, passes the rest to its parent, and is cancelled with it.
func TestMessageContext(t *testing.T) {
	t.Parallel()
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), parentKey{}, "p"))
	at := time.Unix(1700000000, 0)
	m := &sarama.ConsumerMessage{Topic: "t", Partition: 3, Offset: 42, Timestamp: at, Key: []byte("k")}
	slot := &errSlot{}
	ctx := messageContext(parent, m, OrderKey, slot)

	p, ok := kafka.MessagePartitionFromCtx(ctx)
	require.True(t, ok)
	require.Equal(t, int32(3), p)
	off, ok := kafka.MessagePartitionOffsetFromCtx(ctx)
	require.True(t, ok)
	require.Equal(t, int64(42), off)
	ts, ok := kafka.MessageTimestampFromCtx(ctx)
	require.True(t, ok)
	require.Equal(t, at, ts)
	key, ok := kafka.MessageKeyFromCtx(ctx)
	require.True(t, ok)
	require.Equal(t, "k", string(key))
	o, ok := OrderingFromContext(ctx)
	require.True(t, ok)
	require.Equal(t, OrderKey, o)
	require.Same(t, slot, ctx.Value(errSlotKey{}))
	require.Equal(t, "p", ctx.Value(parentKey{}))
	require.Nil(t, ctx.Value([]int{1})) // an uncomparable key is answered, as by context.WithValue
	require.Contains(t, ctx.(interface{ String() string }).String(), "t/3@42")

	child, stop := context.WithCancel(ctx)
	defer stop()
	cancel()
	select {
	case <-child.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a context derived from the message's was not cancelled with the partition's")
	}
	require.ErrorIs(t, ctx.Err(), context.Canceled)
}
