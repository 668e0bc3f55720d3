package retrytopic_test

import (
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// keyOn returns a key that the hash partitioner (Sarama's default, used by
// watermill-kafka's publisher) puts in partition p of a topic with n
// partitions.
func keyOn(t *testing.T, topic string, p, n int32) string {
	t.Helper()
	hp := sarama.NewHashPartitioner(topic)
	for i := range 10000 {
		k := "key-" + string(rune('a'+i%26)) + time.Duration(i).String()
		got, err := hp.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(k)}, n)
		require.NoError(t, err)
		if got == p {
			return k
		}
	}
	t.Fatalf("no key for partition %d", p)
	return ""
}

// copyOf makes m a retry-topic copy of attempt 1 due at notBefore.
func (f *fixture) copyOf(m *message.Message, notBefore time.Time) *message.Message {
	m.Metadata.Set(retrytopic.MetadataAttempt, "1")
	m.Metadata.Set(retrytopic.MetadataNotBefore, notBefore.UTC().Format(time.RFC3339Nano))
	m.Metadata.Set(retrytopic.MetadataOriginalTopic, f.main)
	return m
}

// A copy waiting for its not-before time holds only its own partition of
// the retry topic: the copies of the other partition are processed
// meanwhile, the one behind it in its partition is not; a copy due soon is
// processed, and not before its time. Measured with both holders: the
// HoldingTracer as the subscriber's Tracer, and the middleware's own wait
// in the handler on a plain watermill-kafka subscriber (which keeps one
// message in flight per partition). Closing the router ends the wait.
func TestHoldBlocksOnlyItsPartition(t *testing.T) {
	t.Parallel()
	for _, inHandler := range []bool{false, true} {
		name := "HoldingTracer"
		if inHandler {
			name = "InHandler"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, 1, 2)
			rt, err := retrytopic.New(f.retryConfig(nil), nil)
			require.NoError(t, err)
			var mu sync.Mutex
			ranAt := map[string]time.Time{}
			f.run(t, consumer{rt: rt, dedup: f.newDedup(t), holdInHandler: inHandler}, func(ev event, _ bool) error {
				mu.Lock()
				defer mu.Unlock()
				ranAt[ev.Key] = time.Now()
				return nil
			})
			k0, k1 := keyOn(t, f.retry, 0, 2), keyOn(t, f.retry, 1, 2)

			held := f.copyOf(f.msg(k0, 1), time.Now().Add(time.Hour))
			behind := f.copyOf(f.msg(k0, 2), time.Now().Add(-time.Second))
			other := f.copyOf(f.msg(k1, 1), time.Now().Add(-time.Second))
			require.NoError(t, f.pub.Publish(f.retry, held, behind, other))
			eventually(t, func() bool { return f.rows(t, "key = $1", k1) == 1 }, "the other partition's copy is processed")

			soon := time.Now().Add(500 * time.Millisecond)
			require.NoError(t, f.pub.Publish(f.retry, f.copyOf(f.msg(k1, 2), soon)))
			eventually(t, func() bool { return f.rows(t, "key = $1", k1) == 2 }, "the copy due soon is processed")
			mu.Lock()
			require.False(t, ranAt[k1].Before(soon), "processed at %s, before its not-before %s", ranAt[k1], soon)
			mu.Unlock()

			require.Zero(t, f.rows(t, "key = $1", k0), "the held copy and the one behind it in its partition wait")
			if inHandler {
				require.Positive(t, rt.Stats().Held)
			}
		})
	}
}

// While a copy is held, its consumer still takes part in rebalances: a
// second consumer joins the retry topic's group, the group becomes stable
// with both members, and the free partition is consumed again, although the
// held copy is due in an hour. The group's rebalance timeout is 10 minutes:
// a holder that kept the partition's handler busy (a sleep in the handler
// does, the message context does not end with the session; measured: the
// group then stays in its rebalance) would stall the group far beyond the
// wait below.
func TestHoldingTracerLetsTheGroupRebalance(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, 2)
	base := sarama.NewConfig()
	base.Consumer.Group.Rebalance.Timeout = 10 * time.Minute
	base.Net.ReadTimeout = 11 * time.Minute
	c := func() consumer {
		rt, err := retrytopic.New(f.retryConfig(nil), nil)
		require.NoError(t, err)
		return consumer{rt: rt, dedup: f.newDedup(t), sarama: base}
	}
	f.run(t, c(), nil)
	k0, k1 := keyOn(t, f.retry, 0, 2), keyOn(t, f.retry, 1, 2)
	require.NoError(t, f.pub.Publish(f.retry, f.copyOf(f.msg(k0, 1), time.Now().Add(time.Hour))))
	require.NoError(t, f.pub.Publish(f.retry, f.copyOf(f.msg(k1, 1), time.Now())))
	eventually(t, func() bool { return f.rows(t, "key = $1", k1) == 1 }, "the first consumer runs")

	f.run(t, c(), nil) // joins the group: a rebalance
	eventually(t, func() bool { return groupMembers(t, f.broker.Addrs, f.group+"-retry") == 2 },
		"the retry group is stable with both consumers")
	require.NoError(t, f.pub.Publish(f.retry, f.copyOf(f.msg(k1, 2), time.Now())))
	eventually(t, func() bool { return f.rows(t, "key = $1", k1) == 2 }, "the free partition is consumed after the rebalance")
	require.Zero(t, f.rows(t, "key = $1", k0))
}

// groupMembers returns the number of members of a Stable consumer group,
// 0 while it rebalances.
func groupMembers(t *testing.T, brokers []string, group string) int {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer func() { _ = admin.Close() }()
	desc, err := admin.DescribeConsumerGroups([]string{group})
	require.NoError(t, err)
	if len(desc) != 1 || desc[0].State != "Stable" {
		return 0
	}
	return len(desc[0].Members)
}
