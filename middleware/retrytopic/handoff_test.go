package retrytopic_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// perEvent counts messages by event id.
type perEvent struct {
	mu sync.Mutex
	n  map[string]int
}

func (p *perEvent) add(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[string]int{}
	}
	p.n[id]++
}

func (p *perEvent) get(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n[id]
}

// The proof: one key's first event fails for a while with many
// events behind it. The followers wait in the parked-keys table without
// moving: each is published to the retry topic once (handed off when the
// event before it is released) and consumed there once, at most twice
// each; they are applied in order, each exactly once, one hand-off after
// the other once the first event succeeds (the time it takes is logged).
func TestKeyOrderFollowersWaitWithoutMoving(t *testing.T) {
	t.Parallel()
	followers := 1000
	if testing.Short() {
		followers = 200
	}
	f := newFixture(t, 2, 2)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) {
		c.MaxAttempts = 1000 // the head fails until the test lets it succeed
		c.KeyOrder = f.keyOrder(t)
	}), nil)
	require.NoError(t, err)

	// Every record on the retry topic, read by a group of its own: the
	// publishes of the retry path.
	published := f.collect(t, f.retry)
	// Every message the retry consumer gets: the consumes.
	var consumed perEvent
	observe := func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			if retrytopic.IsRetryTopic(rt, message.SubscribeTopicFromCtx(m.Context())) {
				consumed.add(m.Metadata.Get(publisher.MetadataEventID))
			}
			return h(m)
		}
	}
	var down atomic.Bool
	down.Store(true)
	var headOK, lastApplied atomic.Int64 // unix nanoseconds
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t), observe: observe}, func(ev event, onRetry bool) error {
		switch {
		case ev.N == 0 && down.Load():
			return errDownstream
		case ev.N == 0:
			headOK.Store(time.Now().UnixNano())
		case ev.N == followers:
			lastApplied.Store(time.Now().UnixNano())
		}
		return nil
	})

	const key = "hot"
	msgs := make([]*message.Message, 0, followers+1)
	for n := range followers + 1 {
		msgs = append(msgs, f.msg(key, n))
	}
	f.publish(t, msgs...)
	table := retrytopic.ParkedKeysTable{Schema: f.db.Schema}
	ctx := context.Background()
	eventually(t, func() bool {
		keys, err := parkedsql.Keys(ctx, f.db.Pool, table.Schema, table.Table, f.group, 0, deduplicator.ValidateGroupName)
		require.NoError(t, err)
		return len(keys) == 1 && keys[0].Events == int64(followers+1)
	}, "every follower parked behind the head")
	keys, err := parkedsql.Keys(ctx, f.db.Pool, table.Schema, table.Table, f.group, 0, deduplicator.ValidateGroupName)
	require.NoError(t, err)
	require.Equal(t, key, keys[0].Key)
	require.Equal(t, msgs[0].Metadata.Get(publisher.MetadataEventID), keys[0].Head.String())
	require.Equal(t, f.retry, keys[0].HeadTopic, "only the head has a copy on the retry path")
	sum, err := parkedsql.Summarize(ctx, f.db.Pool, table.Schema, table.Table, f.group, deduplicator.ValidateGroupName)
	require.NoError(t, err)
	require.Equal(t, []parkedsql.Summary{{ConsumerGroup: f.group, Keys: 1, Events: int64(followers + 1), MaxQueue: int64(followers + 1),
		OldestAge: sum[0].OldestAge, MaxHeadOverdue: sum[0].MaxHeadOverdue}}, sum)
	require.Positive(t, sum[0].OldestAge)
	require.Zero(t, f.rows(t, ""), "nothing applied while the head fails")

	down.Store(false)
	eventually(t, func() bool { return f.rows(t, "") == followers+1 }, "every event applied")
	want := make([]int, followers+1)
	for n := range want {
		want[n] = n
	}
	require.Equal(t, want, f.order(t, key), "applied in order")
	f.eachAppliedOnce(t, followers+1)
	t.Logf("%d followers: from the head's success to the last follower applied: %s (forwarder PollInterval %s)",
		followers, time.Duration(lastApplied.Load()-headOK.Load()), forwardPollInterval)

	eventually(t, func() bool { return published.len() >= followers+1 }, "every hand-off seen on the retry topic")
	byID := map[string]int{}
	published.mu.Lock()
	for _, m := range published.msgs {
		byID[m.Metadata.Get(publisher.MetadataEventID)]++
	}
	published.mu.Unlock()
	maxPub, maxCons := 0, 0
	for _, m := range msgs[1:] {
		id := m.Metadata.Get(publisher.MetadataEventID)
		maxPub, maxCons = max(maxPub, byID[id]), max(maxCons, consumed.get(id))
		require.LessOrEqual(t, byID[id], 2, "follower %s published to the retry path at most twice", id)
		require.LessOrEqual(t, consumed.get(id), 2, "follower %s consumed from the retry path at most twice", id)
	}
	t.Logf("per follower on the retry path: at most %d publishes, %d consumes; the head: %d publishes, %d consumes",
		maxPub, maxCons, byID[msgs[0].Metadata.Get(publisher.MetadataEventID)], consumed.get(msgs[0].Metadata.Get(publisher.MetadataEventID)))

	parked, err := retrytopic.ListParked(ctx, f.db.Pool, table, f.group)
	require.NoError(t, err)
	require.Empty(t, parked)
	st := rt.Stats()
	require.EqualValues(t, followers, st.Followed)
	require.EqualValues(t, followers+1, st.Released)
	require.EqualValues(t, followers, st.HandedOff)
}
