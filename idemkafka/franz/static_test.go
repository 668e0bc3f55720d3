package franz_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/internal/kfake"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A static member (InstanceID) that closes keeps its partitions: the other
// member does not get them, and the member that comes back with the same
// InstanceID gets them again. One that does not come back loses them at
// its session timeout. A dynamic member's partitions move to the other
// member at once, with either protocol: the control that shows the test
// can tell the two apart.
func TestSubscriberStaticMemberKeepsItsPartitionsThroughARestart(t *testing.T) {
	t.Parallel()
	if kafkatest.External() != nil {
		t.Skip("sets the broker's KIP-848 heartbeat interval and session timeout: needs the in-process broker")
	}
	// Heartbeats every 250 ms (KIP-848's interval is the broker's, the
	// classic one the client's): a partition that is going to move moves
	// well within the 3 s the test watches. Sessions time out after 6 s
	// (KIP-848's timeout is the broker's, the classic one the client's).
	const heartbeat, session, watch = 250 * time.Millisecond, 6 * time.Second, 3 * time.Second
	c, err := kafkatest.NewFake(kfake.BrokerConfigs(map[string]string{
		"group.consumer.heartbeat.interval.ms": fmt.Sprint(heartbeat.Milliseconds()),
		"group.consumer.session.timeout.ms":    fmt.Sprint(session.Milliseconds()),
	}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	b := &kafkatest.Broker{Addrs: c.ListenAddrs(), Fake: c}

	for _, tc := range []struct {
		protocol         string
		static, comeBack bool
	}{
		{"classic", true, true}, {"consumer", true, true},
		{"classic", true, false}, {"consumer", true, false},
		{"classic", false, false}, {"consumer", false, false},
	} {
		t.Run(fmt.Sprintf("%s/static=%v/back=%v", tc.protocol, tc.static, tc.comeBack), func(t *testing.T) {
			t.Parallel()
			topic := b.Topic(t, "static", 4)
			group := "static-" + topic
			stop := produceSteadily(t, b, topic)
			defer stop()
			var seen handled
			start := func(name, instance string) *franz.Subscriber {
				sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: group, GroupProtocol: tc.protocol,
					InstanceID: instance, ClientOpts: []kgo.Opt{kgo.HeartbeatInterval(heartbeat), kgo.SessionTimeout(session)}}, nil)
				require.NoError(t, err)
				ch, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)
				go func() {
					for m := range ch {
						p, _ := kafka.MessagePartitionFromCtx(m.Context())
						seen.add(name, p)
						m.Ack()
					}
				}()
				return sub
			}
			instance := func(name string) string {
				if tc.static {
					return name
				}
				return ""
			}
			a := start("a", instance("a"))
			defer a.Close()
			bsub := start("b", instance("b"))
			require.Eventually(t, func() bool { return seen.balanced(4) },
				60*time.Second, 50*time.Millisecond, "both members never had partitions: %v", seen.snapshot())
			bParts := seen.partsOf("b")
			require.NoError(t, bsub.Close())
			seen.reset()
			moved := func() bool {
				return slices.ContainsFunc(bParts, func(p int32) bool { return slices.Contains(seen.partsOf("a"), p) })
			}

			// Many heartbeats later, well within the session timeout: a
			// static member's partitions have not moved.
			time.Sleep(watch)
			if !tc.static {
				require.Eventually(t, moved, 60*time.Second, 50*time.Millisecond,
					"a dynamic member's partitions %v stayed unconsumed after it left: %v", bParts, seen.snapshot())
				return
			}
			require.False(t, moved(), "the static member's partitions %v went to the other member: %v", bParts, seen.snapshot())
			if !tc.comeBack {
				require.Eventually(t, moved, 60*time.Second, 50*time.Millisecond,
					"the partitions %v of a static member that did not come back were never reassigned: %v", bParts, seen.snapshot())
				return
			}
			b2 := start("b again", "b")
			defer b2.Close()
			require.Eventually(t, func() bool { return len(seen.partsOf("b again")) == len(bParts) },
				60*time.Second, 50*time.Millisecond, "the restarted member did not get its partitions %v back: %v", bParts, seen.snapshot())
			require.ElementsMatch(t, bParts, seen.partsOf("b again"))
			require.False(t, moved(), "the static member's partitions %v went to the other member: %v", bParts, seen.snapshot())
		})
	}
}

// produceSteadily writes a record to each of 40 keys every 20 ms until
// stop is called.
func produceSteadily(t *testing.T, b *kafkatest.Broker, topic string) (stop func()) {
	t.Helper()
	pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for i := 0; ; i++ {
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
			m := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), nil), fmt.Sprintf("k%d", i%40))
			if err := pub.Publish(topic, m); err != nil {
				t.Errorf("produce: %v", err)
				return
			}
		}
	}()
	return func() {
		close(done)
		<-stopped
		_ = pub.Close()
	}
}

// handled records which member handled records of which partitions.
type handled struct {
	mu    sync.Mutex
	parts map[string]map[int32]bool
	last  map[int32]string // the member that handled each partition's latest record
}

func (h *handled) add(member string, p int32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.parts == nil {
		h.parts, h.last = map[string]map[int32]bool{}, map[int32]string{}
	}
	if h.parts[member] == nil {
		h.parts[member] = map[int32]bool{}
	}
	h.parts[member][p] = true
	h.last[p] = member
}

// partsOf are the partitions whose latest record member handled.
func (h *handled) partsOf(member string) []int32 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []int32
	for p, m := range h.last {
		if m == member {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}

// balanced says whether every one of n partitions has a latest handler
// and the members split them evenly.
func (h *handled) balanced(n int) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	per := map[string]int{}
	for _, m := range h.last {
		per[m]++
	}
	return len(h.last) == n && len(per) == 2 && per["a"] == per["b"]
}

func (h *handled) reset() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.parts, h.last = nil, nil
}

func (h *handled) snapshot() map[string][]int32 {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string][]int32{}
	for m, ps := range h.parts {
		out[m] = slices.Sorted(maps.Keys(ps))
	}
	return out
}

// With an InstanceID a Subscriber holds one live Subscribe call per topic
// (one static member, "<InstanceID>-<topic>"): a second live call on the
// topic is refused, and once the first has ended the topic can be
// subscribed again, under the same name.
func TestSubscriberInstanceIDOneLiveCallPerTopic(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "static-once", 1)
	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "once-" + topic, InstanceID: "pod-0"}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	first, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	_, err = sub.Subscribe(context.Background(), topic)
	require.ErrorContains(t, err, `already has a live Subscribe call on this Subscriber, as static member "pod-0-`+topic+`"`)
	cancel()
	for range first { // closed once the member has left
	}
	again, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	require.NotNil(t, again)
	_, err = sub.Subscribe(context.Background(), strings.Repeat("t", 245))
	require.ErrorContains(t, err, "over Kafka's 249 characters")
}
