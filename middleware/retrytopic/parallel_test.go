package retrytopic_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// The retry topics with KeyOrder on idemkafka's parallel subscriber (key
// order, more messages in flight than partitions, the copies held in their
// partition's window until their not-before time): each key's events are
// applied exactly once, in strictly increasing order. A fifth of the events
// fail on the main topic until they are on the retry path (their key's
// later events follow them there); the copies of half the keys fail once
// more on the retry topic (watermill's Retry retries them in process).
func TestKeyOrderOnParallelSubscriber(t *testing.T) {
	t.Parallel()
	const keys, perKey = 12, 6
	f := newFixture(t, 2, 2)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) {
		c.MaxAttempts = 5
		c.KeyOrder = f.keyOrder(t)
	}), nil)
	require.NoError(t, err)
	var log runLog
	var inflight, maxInFlight atomic.Int64
	keyIndex := func(ev event) int {
		var k int
		_, _ = fmt.Sscanf(ev.Key, "k%d", &k)
		return k
	}
	failsOnMain := func(ev event) bool { return (keyIndex(ev)*7+ev.N)%5 == 0 }
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t), parallel: 8}, func(ev event, onRetry bool) error {
		n := inflight.Add(1)
		defer inflight.Add(-1)
		for m := maxInFlight.Load(); n > m && !maxInFlight.CompareAndSwap(m, n); m = maxInFlight.Load() {
		}
		time.Sleep(2 * time.Millisecond) // a downstream call: lets the handlers overlap
		log.add(ev, onRetry)
		switch {
		case !onRetry && failsOnMain(ev):
			return errDownstream
		case onRetry && failsOnMain(ev) && keyIndex(ev)%2 == 0 && countTrue(log.get(ev)) == 1:
			return errDownstream // the copy's first run; its in-process retry succeeds
		}
		return nil
	})

	var msgs []*message.Message
	for n := range perKey {
		for k := range keys {
			msgs = append(msgs, f.msg(fmt.Sprintf("k%d", k), n))
		}
	}
	f.publish(t, msgs...)

	eventually(t, func() bool { return f.rows(t, "") == keys*perKey }, "every event applied")
	want := make([]int, perKey)
	for n := range want {
		want[n] = n
	}
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		require.Equal(t, want, f.order(t, key), "key %s: each event once, in order", key)
	}
	f.eachAppliedOnce(t, keys*perKey)
	st := rt.Stats()
	require.Positive(t, st.Retried, "events went through the retry topic")
	require.Positive(t, st.Followed, "later events followed their key's retried one")
	require.Zero(t, st.Exhausted)
	parked, err := retrytopic.ListParked(t.Context(), f.db.Pool, retrytopic.ParkedKeysTable{Schema: f.db.Schema}, f.group)
	require.NoError(t, err)
	require.Empty(t, parked, "every parked key was released")
	require.Greater(t, maxInFlight.Load(), int64(2), "more handlers at once than the main topic's partitions")
}

func countTrue(xs []bool) int {
	n := 0
	for _, x := range xs {
		if x {
			n++
		}
	}
	return n
}

// KeyOrder refuses the messages of an parallel.Subscriber with OrderNone,
// which hands out a key's events in any order: the message is nacked with
// ErrKeyOrderUnordered, its handler never runs, nothing is parked, moved
// or poisoned. With OrderKey the same message reaches the handler.
func TestKeyOrderRefusesOrderNone(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, 1)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) { c.KeyOrder = f.keyOrder(t) }), nil)
	require.NoError(t, err)
	f.publish(t, f.msg("a", 1))
	for _, tc := range []struct {
		ordering parallel.Ordering
		refused  bool
	}{
		{parallel.OrderNone, true},
		{parallel.OrderKey, false},
	} {
		sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
			Client: idemkafka.ClientConfig{Brokers: f.broker.Addrs, RevokeTimeout: 5 * time.Second}, ConsumerGroup: f.group + "-" + tc.ordering.String(), Ordering: tc.ordering,
		}, nil)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := sub.Subscribe(ctx, f.main)
		require.NoError(t, err)
		msg := <-ch
		var called bool
		_, err = rt.Middleware(func(*message.Message) ([]*message.Message, error) {
			called = true
			return nil, nil
		})(msg)
		if tc.refused {
			require.ErrorIs(t, err, retrytopic.ErrKeyOrderUnordered)
			require.False(t, called)
			msg.Nack()
		} else {
			require.NoError(t, err)
			require.True(t, called)
			msg.Ack()
		}
		cancel()
		require.NoError(t, sub.Close())
	}
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM retry_parked_key"), "nothing parked")
}
