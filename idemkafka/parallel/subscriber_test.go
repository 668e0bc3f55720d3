package parallel_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

// Each key's events are applied once each, in order, while handlers fail
// and are retried in-process (watermill's Retry) and nacked once the
// retries are spent, with more messages in flight than partitions.
func TestSubscriberKeyOrderUnderNacksAndRetries(t *testing.T) {
	const keys, perKey = 40, 15
	f := newFixture(t, 4, 8)
	f.produce(t, keys, perKey)

	cfg := f.config("nacks")
	cfg.MaxInFlight = 8
	sub := f.subscriber(t, cfg)
	var attempts sync.Map // key/seq -> attempts
	var maxInFlight atomic.Int64
	var inflight atomic.Int64
	fail := func(ev event) error {
		n := inflight.Add(1)
		defer inflight.Add(-1)
		for {
			m := maxInFlight.Load()
			if n <= m || maxInFlight.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(time.Millisecond)
		v, _ := attempts.LoadOrStore(ev, new(atomic.Int32))
		a := v.(*atomic.Int32).Add(1)
		switch {
		case ev.Seq%3 == 0 && a <= 2: // the in-process retry succeeds
			return errors.New("transient")
		case ev.Seq%5 == 0 && a <= 3: // Retry gives up: nacked, redelivered
			return errors.New("longer outage")
		}
		return nil
	}
	f.router(t, sub, f.db.Pool, 1, nil, ledgerHandler(fail))
	f.waitApplied(t, keys*perKey)
	f.verifyLedger(t, keys, perKey)
	require.Greater(t, sub.Stats().Nacked, uint64(0))
	require.Greater(t, maxInFlight.Load(), int64(4), "more handlers at once than partitions")
}

// gate blocks handlers by event until opened, and reports which started.
type gate struct {
	mu      sync.Mutex
	open    map[event]chan struct{}
	started chan event
}

// blockedHeadAndFive publishes a's first event, then one event of each of
// five other keys, and returns a's event with a gate that holds its
// handler.
func (f *fixture) blockedHeadAndFive(t *testing.T) (event, *gate) {
	t.Helper()
	msgs := []*message.Message{f.event(t, "a", 1)}
	for i := range 5 {
		msgs = append(msgs, f.event(t, keyName(i), 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	a1 := event{"a", 1}
	g := newGate()
	g.block(a1)
	return a1, g
}

func newGate() *gate {
	return &gate{open: map[event]chan struct{}{}, started: make(chan event, 100)}
}

func (g *gate) ch(ev event) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, ok := g.open[ev]
	if !ok {
		c = make(chan struct{})
		g.open[ev] = c
	}
	return c
}

// block makes ev's handler wait until release(ev).
func (g *gate) block(ev event) { g.ch(ev) }

// release lets ev's handler go on (again: a no-op).
func (g *gate) release(ev event) {
	c := g.ch(ev)
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

// releaseAll releases every gate: a test registers it after its router, so
// that a test failing while a handler is held still stops its router
// (cleanups run last registered first).
func (g *gate) releaseAll() {
	g.mu.Lock()
	evs := make([]event, 0, len(g.open))
	for ev := range g.open {
		evs = append(evs, ev)
	}
	g.mu.Unlock()
	for _, ev := range evs {
		g.release(ev)
	}
}

func (g *gate) fail(blocked map[event]bool) func(event) error {
	return func(ev event) error {
		g.started <- ev
		if blocked[ev] {
			<-g.ch(ev)
		}
		return nil
	}
}

// In OrderKey a message of another key passes a slow one in the same
// partition; a later message of the slow key waits for it. In
// OrderPartition nothing passes it.
func TestSubscriberOrderingModes(t *testing.T) {
	for _, tc := range []struct {
		ordering parallel.Ordering
		bPasses  bool
	}{
		{parallel.OrderKey, true},
		{parallel.OrderPartition, false},
	} {
		t.Run(tc.ordering.String(), func(t *testing.T) {
			f := newFixture(t, 1, 4)
			a1, a2, b1 := event{"a", 1}, event{"a", 2}, event{"b", 1}
			require.NoError(t, f.pub.Publish(f.topic, f.event(t, "a", 1), f.event(t, "a", 2), f.event(t, "b", 1)))
			g := newGate()
			g.block(a1)
			cfg := f.config("modes")
			cfg.Ordering = tc.ordering
			sub := f.subscriber(t, cfg)
			f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(g.fail(map[event]bool{a1: true})))
			t.Cleanup(g.releaseAll)

			first := <-g.started
			if tc.bPasses {
				second := <-g.started
				require.ElementsMatch(t, []event{a1, b1}, []event{first, second}, "b passes the blocked a")
				f.waitApplied(t, 1)
				// b1's ack follows its COMMIT: its row can be seen first.
				waitFor(t, "b1 acked", func() bool { return sub.Stats().Acked == 1 })
				st := sub.Stats()
				require.Equal(t, 1, st.InFlight)
				require.Equal(t, 1, st.KeysWaiting, "a2 waits for a1")
				require.Equal(t, int64(0), st.Partitions[0].Committed, "nothing below a1 is done")
				require.Equal(t, int64(3), st.Partitions[0].Distance)
			} else {
				require.Equal(t, a1, first)
				waitFor(t, "the later messages to wait", func() bool { return sub.Stats().KeysWaiting == 2 })
				require.Equal(t, 1, sub.Stats().InFlight)
			}
			g.release(a1)
			if tc.bPasses {
				require.Equal(t, a2, <-g.started)
			} else {
				require.Equal(t, []event{a2, b1}, []event{<-g.started, <-g.started})
			}
			f.waitApplied(t, 3)
		})
	}
}

// A nacked message is handed out again after NackResendSleep; the later
// messages of its key wait behind it, other keys keep flowing.
func TestSubscriberNackWaitsOnlyItsKey(t *testing.T) {
	f := newFixture(t, 1, 4)
	a1, a2, b1 := event{"a", 1}, event{"a", 2}, event{"b", 1}
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "a", 1), f.event(t, "a", 2), f.event(t, "b", 1)))
	bDone := make(chan struct{})
	var aFailed atomic.Bool
	var order []event
	var mu sync.Mutex
	sub := f.subscriber(t, f.config("nack"))
	fail := func(ev event) error {
		mu.Lock()
		order = append(order, ev)
		mu.Unlock()
		switch ev {
		case a1:
			select {
			case <-bDone:
				return nil
			default:
				aFailed.Store(true)
				return errors.New("a1 fails until b1 is done")
			}
		case b1:
			waitFor(t, "a1 to fail", aFailed.Load)
			defer close(bDone)
		}
		return nil
	}
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(fail))
	f.waitApplied(t, 3)
	mu.Lock()
	defer mu.Unlock()
	var as []event
	for _, ev := range order {
		if ev.Key == "a" {
			as = append(as, ev)
		}
	}
	require.Equal(t, a2, as[len(as)-1], "a2 ran once, after a1 succeeded")
	for _, ev := range as[:len(as)-1] {
		require.Equal(t, a1, ev)
	}
	f.verifyLedgerKeys(t, map[string]int{"a": 2, "b": 1})
}

// The window bounds what a partition holds: with its window full the
// subscriber stops reading the partition.
func TestSubscriberWindowBoundsFetching(t *testing.T) {
	f := newFixture(t, 1, 4)
	const n = 20
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, f.event(t, keyName(i), 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	cfg := f.config("window")
	cfg.MaxInFlight = 2
	cfg.PartitionWindow = 5
	sub := f.subscriber(t, cfg)
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	t.Cleanup(open)
	var started atomic.Int32
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(event) error {
		started.Add(1)
		<-release
		return nil
	}))
	waitFor(t, "two in flight", func() bool { return sub.Stats().InFlight == 2 })
	waitFor(t, "a full window", func() bool { return sub.Stats().Partitions[0].Window == 5 })
	waitFor(t, "two handlers", func() bool { return started.Load() == 2 })
	require.Equal(t, 2, sub.Stats().InFlight)
	open()
	f.waitApplied(t, n)
	require.LessOrEqual(t, sub.Stats().Partitions[0].Window, 5)
}

// Only the offset below the lowest unacked message is committed; the done
// ones above it are recorded in the commit metadata, so the next owner
// skips them and gets only the unacked one again.
func TestSubscriberCommitsBelowLowestUnacked(t *testing.T) {
	f := newFixture(t, 1, 4)
	a1, g := f.blockedHeadAndFive(t)
	cfg := f.config("commit")
	cfg.Client.RevokeTimeout = 100 * time.Millisecond
	sub := f.subscriber(t, cfg)
	var firstHandled sync.Map
	stop := f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		firstHandled.Store(ev, true)
		if ev == a1 {
			<-g.ch(a1)
			return errors.New("abandoned")
		}
		return nil
	}))
	t.Cleanup(g.releaseAll)
	f.waitApplied(t, 5)
	committed := func() (int64, string) {
		admin := f.admin(t)
		defer admin.Close()
		resp, err := admin.ListConsumerGroupOffsets("commit", map[string][]int32{f.topic: {0}})
		require.NoError(t, err)
		b := resp.GetBlock(f.topic, 0)
		return b.Offset, b.Metadata
	}
	waitFor(t, "the done offsets in the commit metadata", func() bool {
		_, meta := committed()
		return meta != ""
	})
	off, _ := committed()
	require.Equal(t, int64(0), off, "a1 at offset 0 is not done")
	go func() {
		time.Sleep(200 * time.Millisecond) // past RevokeTimeout: a1 is abandoned
		g.release(a1)
	}()
	stop()

	// The next owner.
	sub2 := f.subscriber(t, f.config("commit"))
	var second []event
	var mu sync.Mutex
	f.router(t, sub2, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		mu.Lock()
		second = append(second, ev)
		mu.Unlock()
		return nil
	}))
	f.waitApplied(t, 6)
	mu.Lock()
	require.Equal(t, []event{a1}, second)
	mu.Unlock()
	require.Equal(t, uint64(5), sub2.Stats().Skipped)
}

// The messages carry watermill-kafka's context values.
func TestSubscriberContextValues(t *testing.T) {
	f := newFixture(t, 2, 2)
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "a", 1)))
	sub := f.subscriber(t, f.config("ctx"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, f.topic)
	require.NoError(t, err)
	msg := <-ch
	p, ok := kafka.MessagePartitionFromCtx(msg.Context())
	require.True(t, ok)
	off, ok := kafka.MessagePartitionOffsetFromCtx(msg.Context())
	require.True(t, ok)
	require.Equal(t, int64(0), off)
	key, ok := kafka.MessageKeyFromCtx(msg.Context())
	require.True(t, ok)
	require.Equal(t, "a", string(key))
	ts, ok := kafka.MessageTimestampFromCtx(msg.Context())
	require.True(t, ok)
	require.False(t, ts.IsZero())
	var ev event
	require.NoError(t, json.Unmarshal(msg.Payload, &ev))
	require.Equal(t, event{"a", 1}, ev)
	require.Equal(t, []parallel.PartitionStats{{Topic: f.topic, Partition: p, Committed: 0, HighestHandedOut: 0, Distance: 1, Window: 1}},
		filterPartition(sub.Stats().Partitions, p))
	msg.Ack()
	require.NoError(t, sub.Close())
	_, open := <-ch
	require.False(t, open)
}

func filterPartition(ps []parallel.PartitionStats, p int32) []parallel.PartitionStats {
	var out []parallel.PartitionStats
	for _, s := range ps {
		if s.Partition == p {
			out = append(out, s)
		}
	}
	return out
}

func TestSubscriberConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		field string
		mod   func(*parallel.SubscriberConfig)
	}{
		{"Client.Brokers", func(c *parallel.SubscriberConfig) { c.Client.Brokers = nil }},
		{"ConsumerGroup", func(c *parallel.SubscriberConfig) { c.ConsumerGroup = "" }},
		{"Ordering", func(c *parallel.SubscriberConfig) { c.Ordering = 7 }},
		{"MaxInFlight", func(c *parallel.SubscriberConfig) { c.MaxInFlight = -1 }},
		{"PartitionWindow", func(c *parallel.SubscriberConfig) { c.PartitionWindow = -1 }},
		{"Client.RevokeTimeout", func(c *parallel.SubscriberConfig) { c.Client.RevokeTimeout = time.Hour }},
		{"StallTimeout", func(c *parallel.SubscriberConfig) { c.StallTimeout = -2 }},
	} {
		t.Run(tc.field, func(t *testing.T) {
			cfg := parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: []string{"127.0.0.1:1"}}, ConsumerGroup: "g"}
			tc.mod(&cfg)
			_, err := parallel.NewSubscriber(cfg, nil)
			require.ErrorContains(t, err, "parallel: invalid config: "+tc.field+": ")
		})
	}
}
