package franz

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A key whose head keeps failing fills its partition's window with the
// records behind it; the partition's fetching then pauses, so that the
// window holds at most PartitionWindow + PollRecords - 1 records and the
// later records are not read; once the head is acked, fetching resumes
// and everything is handed out.
func TestWindowPausesAFullPartition(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "window", 1)
	pub, err := NewPublisher(PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	defer pub.Close()
	var msgs []*message.Message
	for i := range 20 {
		key := "bad"
		if i >= 10 {
			key = fmt.Sprintf("ok%d", i)
		}
		m := message.NewMessage(watermill.NewUUID(), []byte(key))
		m.Metadata.Set(publisher.MetadataPartitionKey, key)
		msgs = append(msgs, m)
	}
	require.NoError(t, pub.Publish(topic, msgs...))

	const window, poll = 4, 2
	sub, err := NewSubscriber(SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "window", PartitionWindow: window, PollRecords: poll,
		NackResendSleep: time.Millisecond}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var (
		release  atomic.Bool
		nacks    atomic.Int32
		mu       sync.Mutex
		acked    int
		okBefore int // ok records handed out while the head failed
	)
	go func() {
		for msg := range ch {
			if string(msg.Payload) == "bad" && !release.Load() {
				nacks.Add(1)
				msg.Nack()
				continue
			}
			mu.Lock()
			if string(msg.Payload) != "bad" && !release.Load() {
				okBefore++
			}
			acked++
			mu.Unlock()
			msg.Ack()
		}
	}()
	require.Eventually(t, func() bool { return nacks.Load() >= 20 }, 60*time.Second, time.Millisecond, "the head nacked again and again")
	var st *stream
	sub.mu.Lock()
	for s := range sub.streams {
		st = s
	}
	sub.mu.Unlock()
	st.mu.Lock()
	p := st.parts[0]
	require.NotNil(t, p)
	require.True(t, p.paused, "the full partition's fetching is paused")
	require.LessOrEqual(t, p.win.Undone(), window+poll-1, "the window holds more than PartitionWindow + PollRecords - 1 records")
	st.mu.Unlock()
	mu.Lock()
	require.Zero(t, okBefore, "records past the full window were read")
	mu.Unlock()
	release.Store(true)
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return acked == 20 }, 60*time.Second, 10*time.Millisecond)
}

func TestShareOfSplitsMaxInFlight(t *testing.T) {
	for _, tc := range []struct {
		max, members int
		want         []int
	}{{64, 2, []int{32, 32}}, {5, 2, []int{3, 2}}, {7, 3, []int{3, 2, 2}}, {1, 1, []int{1}}} {
		got := shareOf(tc.max, tc.members)
		if !slices.Equal(got, tc.want) {
			t.Errorf("shareOf(%d, %d) = %v, want %v", tc.max, tc.members, got, tc.want)
		}
	}
}
