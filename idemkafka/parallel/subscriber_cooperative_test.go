package parallel_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

// cooperative is cfg under the cooperative-sticky strategy.
func cooperative(cfg parallel.SubscriberConfig) parallel.SubscriberConfig {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_4_0_0
	sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	cfg.Client.Sarama = sc
	return cfg
}

// revocations records the partitions a subscriber gave up, in order.
type revocations struct {
	mu    sync.Mutex
	parts []int32
}

func watchRevocations(sub *parallel.Subscriber) *revocations {
	r := &revocations{}
	parallel.SetRevokeHook(sub, func(p int32) {
		r.mu.Lock()
		r.parts = append(r.parts, p)
		r.mu.Unlock()
	})
	return r
}

func (r *revocations) list() []int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.parts)
}

// owned is the partitions sub holds now, ascending.
func owned(sub *parallel.Subscriber) []int32 {
	var out []int32
	for _, p := range sub.Stats().Partitions {
		out = append(out, p.Partition)
	}
	slices.Sort(out)
	return out
}

// Under cooperative-sticky a second member joins and later leaves while the
// events flow: the first member keeps one session throughout, gives up
// exactly the partitions that move to the second (the others are never
// revoked, so never drained), and takes them back mid-session when the
// second leaves; every event is applied once, each key in order.
func TestSubscriberCooperativeRevokesOnlyWhatMoves(t *testing.T) {
	const keys, perKey, parts = 60, 25, 6
	f := newFixture(t, parts, 8)
	slow := ledgerHandler(func(event) error {
		time.Sleep(2 * time.Millisecond)
		return nil
	})
	cfg := cooperative(f.config("coop"))
	cfg.MaxInFlight = 4
	count := func() int { return f.db.Count(t, "SELECT 1 FROM ledger") }

	f.produceSeqs(t, keys, 1, 5)
	a := f.subscriber(t, cfg)
	revokedA := watchRevocations(a)
	f.router(t, a, f.db.Pool, 0, nil, slow)
	waitFor(t, "a owns every partition", func() bool { return len(owned(a)) == parts })
	waitFor(t, "some events", func() bool { return count() >= 100 })

	b := f.subscriber(t, cfg)
	revokedB := watchRevocations(b)
	stopB := f.router(t, b, f.db.Pool, 0, nil, slow)
	f.produceSeqs(t, keys, 6, 10) // while the group rebalances
	waitFor(t, "b owns partitions", func() bool {
		return len(owned(b)) > 0 && len(owned(a))+len(owned(b)) == parts
	})
	kept, moved := owned(a), owned(b)
	require.Equal(t, moved, sortedCopy(revokedA.list()), "a gave up exactly the partitions that moved to b")
	f.produceSeqs(t, keys, 11, 15)
	waitFor(t, "events on b", func() bool { return b.Stats().Acked > 0 })

	stopB()
	require.ElementsMatch(t, moved, revokedB.list(), "b gave up its partitions when it left")
	f.produceSeqs(t, keys, 16, perKey) // while a takes them back
	waitFor(t, "a owns every partition again", func() bool { return len(owned(a)) == parts })
	f.waitApplied(t, keys*perKey)
	f.verifyLedger(t, keys, perKey)

	require.Equal(t, uint64(1), a.Stats().Sessions, "one session across both rebalances")
	require.Equal(t, moved, sortedCopy(revokedA.list()), "the partitions a kept were never revoked: %v", kept)
}

func sortedCopy(ps []int32) []int32 {
	out := slices.Clone(ps)
	slices.Sort(out)
	return out
}

// Under cooperative-sticky a partition whose window is full (every record
// a key's head, its handlers blocked) is revoked like any other: its
// member sees the claim end, gives the messages in flight RevokeTimeout,
// and lets the partition go within the same session, instead of holding
// the rebalance until its deadline (which would end the whole session).
func TestSubscriberCooperativeReleasesAFullWindow(t *testing.T) {
	const n = 40
	f := newFixture(t, 2, 8)
	for i := range n {
		require.NoError(t, f.pub.Publish(f.topic, f.event(t, keyName(i), 1)))
	}
	cfg := cooperative(f.config("coopfull"))
	cfg.Client.Sarama.Consumer.Group.Rebalance.Timeout = 20 * time.Second
	a, blocked, open := f.fullMember(t, &cfg)

	b := f.subscriber(t, cfg)
	f.router(t, b, f.db.Pool, 0, nil, blocked)
	waitFor(t, "b owns a partition", func() bool { return len(owned(b)) == 1 && len(owned(a)) == 1 })
	require.Equal(t, uint64(1), a.Stats().Sessions, "a let the partition go within its session")
	open()
	f.waitApplied(t, n)
	want := map[string]int{}
	for i := range n {
		want[keyName(i)] = 1
	}
	f.verifyLedgerKeys(t, want)
}

// A partition revoked while its window was full (its fetching paused in
// Sarama) and given back to the same member is fetched again: Sarama's
// consumer keeps a partition's pause across a reassignment, so the new
// claim resumes it. Under eager rebalancing too, where every partition is
// revoked and the consumer is the same.
func TestSubscriberResumesAPartitionItGetsBack(t *testing.T) {
	for _, coop := range []bool{true, false} {
		name := "eager"
		if coop {
			name = "cooperative"
		}
		t.Run(name, func(t *testing.T) {
			const n = 40
			f := newFixture(t, 2, 8)
			for i := range n {
				require.NoError(t, f.pub.Publish(f.topic, f.event(t, keyName(i), 1)))
			}
			cfg := f.config("back")
			if coop {
				cfg = cooperative(cfg)
			}
			a, _, open := f.fullMember(t, &cfg)

			b := f.subscriber(t, cfg)
			stopB := f.router(t, b, f.db.Pool, 0, nil, ledgerHandler(nil))
			waitFor(t, "b owns a partition", func() bool { return len(owned(b)) == 1 && len(owned(a)) == 1 })
			stopB()
			waitFor(t, "a owns both partitions again", func() bool { return len(owned(a)) == 2 })
			for i := n; i < 2*n; i++ {
				require.NoError(t, f.pub.Publish(f.topic, f.event(t, keyName(i), 1)))
			}
			open()
			f.waitApplied(t, 2*n)
			want := map[string]int{}
			for i := range 2 * n {
				want[keyName(i)] = 1
			}
			f.verifyLedgerKeys(t, want)
		})
	}
}

// fullWindows sets cfg for windows that fill at once (a window of 5, two
// messages in flight, a revocation given a second) and returns a handler
// that blocks until open is called (at the latest when the test ends).
func fullWindows(t *testing.T, cfg *parallel.SubscriberConfig) (blocked message.HandlerFunc, open func()) {
	cfg.Client.RevokeTimeout = time.Second
	cfg.MaxInFlight = 2
	cfg.PartitionWindow = 5
	release := make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(release) }) }
	t.Cleanup(open)
	return ledgerHandler(func(event) error {
		<-release
		return nil
	}), open
}

// fullMember starts a member on cfg (set by fullWindows) whose handlers
// block, and waits until both of its partitions' windows are full.
func (f *fixture) fullMember(t *testing.T, cfg *parallel.SubscriberConfig) (a *parallel.Subscriber, blocked message.HandlerFunc, open func()) {
	blocked, open = fullWindows(t, cfg)
	a = f.subscriber(t, *cfg)
	f.router(t, a, f.db.Pool, 0, nil, blocked)
	waitFor(t, "both windows full", func() bool {
		ps := a.Stats().Partitions
		return len(ps) == 2 && ps[0].Window == 5 && ps[1].Window == 5
	})
	return a, blocked, open
}

// Subscribers that share one sarama.Config share its strategy values, and
// Sarama's sticky strategies keep each Plan's state in theirs: two groups
// led from one process would plan on one map at once (a data race, then a
// panic inside Plan, seen in the soak with the main topic's and a retry
// topic's subscribers). Each Subscribe plans with strategies of its own:
// under -race, two groups joining and rebalancing at once stay quiet.
func TestSubscribersSharingOneSaramaConfigPlanApart(t *testing.T) {
	const parts = 4
	f := newFixture(t, parts, 4)
	shared := cooperative(f.config("")).Client.Sarama
	var subs []*parallel.Subscriber
	for _, group := range []string{"plan-a", "plan-b"} {
		cfg := f.config(group)
		cfg.Client.Sarama = shared
		subs = append(subs, f.subscriber(t, cfg))
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		for _, s := range subs {
			_ = s.Close()
		}
	})
	// Two members per group, all four joining at once: each group's leader
	// plans twice (the first member alone, then both).
	var wg sync.WaitGroup
	for range 2 {
		for _, s := range subs {
			wg.Go(func() {
				_, err := s.Subscribe(ctx, f.topic)
				require.NoError(t, err)
			})
		}
	}
	wg.Wait()
	for _, s := range subs {
		waitFor(t, "every partition owned in each group", func() bool { return len(s.Stats().Partitions) == parts })
	}
}
