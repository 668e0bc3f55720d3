package franz_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
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
// member never gets them, and the member that comes back with the same
// InstanceID gets them again. A dynamic member's partitions move to the
// other member, with either protocol: the control that shows the test
// can tell the two apart.
func TestSubscriberStaticMemberKeepsItsPartitionsThroughARestart(t *testing.T) {
	t.Parallel()
	if kafkatest.External() != nil {
		t.Skip("sets the broker's KIP-848 heartbeat interval: needs the in-process broker")
	}
	// Heartbeats every 250 ms (KIP-848's interval is the broker's; the
	// classic one the client's): a partition that is going to move moves
	// well within the wait below.
	const heartbeat = 250 * time.Millisecond
	c, err := kafkatest.NewFake(kfake.BrokerConfigs(map[string]string{"group.consumer.heartbeat.interval.ms": fmt.Sprint(heartbeat.Milliseconds())}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	b := &kafkatest.Broker{Addrs: c.ListenAddrs(), Fake: c}

	for _, tc := range []struct {
		protocol string
		static   bool
	}{{"classic", true}, {"consumer", true}, {"classic", false}, {"consumer", false}} {
		t.Run(fmt.Sprintf("%s/static=%v", tc.protocol, tc.static), func(t *testing.T) {
			t.Parallel()
			topic := b.Topic(t, "static", 4)
			group := "static-" + topic
			stop := produceSteadily(t, b, topic)
			defer stop()
			var seen handled
			start := func(name, instance string) *franz.Subscriber {
				sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: group, GroupProtocol: tc.protocol,
					InstanceID: instance, ClientOpts: []kgo.Opt{kgo.HeartbeatInterval(heartbeat)}}, nil)
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
			require.Eventually(t, func() bool { return len(seen.partsOf("a")) > 0 && len(seen.partsOf("b")) > 0 && seen.balanced(4) },
				60*time.Second, 50*time.Millisecond, "both members never had partitions: %v", seen.snapshot())
			bParts := seen.partsOf("b")
			require.NoError(t, bsub.Close())
			seen.reset()

			// Many heartbeats later: where did b's partitions go?
			time.Sleep(40 * heartbeat)
			moved := slices.ContainsFunc(bParts, func(p int32) bool { return slices.Contains(seen.partsOf("a"), p) })
			if !tc.static {
				require.True(t, moved, "a dynamic member's partitions %v stayed unconsumed after it left: %v", bParts, seen.snapshot())
				return
			}
			require.False(t, moved, "the static member's partitions %v went to the other member: %v", bParts, seen.snapshot())

			b2 := start("b again", "b")
			defer b2.Close()
			require.Eventually(t, func() bool { return len(seen.partsOf("b again")) == len(bParts) },
				60*time.Second, 50*time.Millisecond, "the restarted member did not get its partitions %v back: %v", bParts, seen.snapshot())
			require.ElementsMatch(t, bParts, seen.partsOf("b again"))
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
