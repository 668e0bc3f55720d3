package parallel_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

// With every MaxInFlight slot taken and heads queued for one, the handlers
// hold the partition up, not a key: nothing is spilled, and nothing is read
// again from Kafka, however long the handlers run. (Spilling heads queued
// for a slot made the parallel subscriber with group commit re-read about
// a third of a backlog: issue 50.) Here 8 keys have 10 records each on one
// partition, MaxInFlight is 2 and PartitionWindow 16: the window fills with
// 8 heads (2 in flight, 6 queued) and 8 waiting records, and the handlers
// are held until each head has stalled, running or queued (StallTimeout 200
// ms: four times minSlow, after which a head used to count as slow).
func TestSubscriberSpillsNothingWhileSaturated(t *testing.T) {
	const keys, perKey = 8, 10
	f := newFixture(t, 1, 4)
	f.produce(t, keys, perKey)

	cfg := f.config("saturated")
	cfg.MaxInFlight = 2
	cfg.PartitionWindow = 16
	cfg.StallTimeout = 200 * time.Millisecond
	sub := f.subscriber(t, cfg)
	hold := make(chan struct{})
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(event) error {
		<-hold
		return nil
	}))
	released := false
	release := func() {
		if !released {
			released = true
			close(hold)
		}
	}
	t.Cleanup(release)

	// A head stalls StallTimeout after it became its key's head; a running
	// one is slow only once its handler has run that long, which on a busy
	// machine can be later (it was handed out after it became head).
	waitFor(t, "every head stalled, the running ones for StallTimeout", func() bool {
		s := sub.Stats()
		if s.StalledKeys != keys || s.InFlight != cfg.MaxInFlight {
			return false
		}
		for _, st := range s.Stalls {
			if st.Running > 0 && st.Running < cfg.StallTimeout {
				return false
			}
		}
		return true
	})
	s := sub.Stats()
	causes := map[parallel.StallCause]int{}
	for _, st := range s.Stalls {
		causes[st.Cause]++
	}
	require.Equal(t, map[parallel.StallCause]int{parallel.StallSlow: 2, parallel.StallQueued: keys - 2}, causes)
	require.Equal(t, cfg.PartitionWindow, s.Partitions[0].Window, "the window is full")
	require.Zero(t, s.Spilled, "no record spilled while every slot is taken")
	require.Zero(t, s.Refetched)
	require.Equal(t, keys, s.KeysWaiting, "each key's second record waits, its payload kept")

	release()
	f.waitApplied(t, keys*perKey)
	f.verifyLedger(t, keys, perKey)
}

// partitionOf is the partition of 2 that the publisher's hash partitioner
// gives key.
func partitionOf(t *testing.T, topic, key string) int32 {
	t.Helper()
	p, err := sarama.NewHashPartitioner(topic).Partition(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key)}, 2)
	require.NoError(t, err)
	return p
}

// keysOn returns n keys named prefix-i that land on partition.
func keysOn(t *testing.T, topic, prefix string, partition int32, n int) []string {
	t.Helper()
	var keys []string
	for i := 0; len(keys) < n; i++ {
		if k := fmt.Sprintf("%s-%d", prefix, i); partitionOf(t, topic, k) == partition {
			keys = append(keys, k)
		}
	}
	return keys
}

// A partition whose window is full of a blocked key's records, with no
// ready record of its own, still spills while another partition keeps
// every MaxInFlight slot taken and has records queued for one: it holds
// fewer messages in flight than its share, so the next freed slots are its
// (stream.pickReady), and waiting for the stream to be idle would stop it
// as long as the other partition has work. Partition B's 3 keys have their
// handlers held (2 in flight, 1 queued); then partition A gets a key held
// by NotBeforeFunc with 12 records (a window of 8) and 4 keys behind them:
// A spills, and once B's handlers go on, A's 4 keys are applied while the
// held key still waits.
func TestSubscriberStarvedPartitionSpillsWhileAnotherSaturates(t *testing.T) {
	f := newFixture(t, 2, 4)
	bKeys := keysOn(t, f.topic, "b", 1, 3)
	aKeys := keysOn(t, f.topic, "a", 0, 5)
	held := aKeys[0]

	cfg := f.config("starved")
	cfg.MaxInFlight = 2
	cfg.PartitionWindow = 8
	cfg.NotBeforeFunc = func(m *sarama.ConsumerMessage) time.Time {
		if string(m.Key) == held {
			return time.Now().Add(time.Hour)
		}
		return time.Time{}
	}
	sub := f.subscriber(t, cfg)
	hold := make(chan struct{})
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev.Key[0] == 'b' {
			<-hold
		}
		return nil
	}))
	released := false
	release := func() {
		if !released {
			released = true
			close(hold)
		}
	}
	t.Cleanup(release)

	var msgs []*message.Message
	for _, k := range bKeys {
		msgs = append(msgs, f.event(t, k, 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	waitFor(t, "B's handlers holding every slot, one of its records queued", func() bool {
		s := sub.Stats()
		return s.InFlight == cfg.MaxInFlight && windowOf(s, 1) == len(bKeys)
	})

	msgs = nil
	for seq := 1; seq <= 12; seq++ {
		msgs = append(msgs, f.event(t, held, seq))
	}
	for _, k := range aKeys[1:] {
		msgs = append(msgs, f.event(t, k, 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	waitFor(t, "A spilling the held key's records while B holds every slot", func() bool {
		return sub.Stats().Spilled > 0
	})
	require.Equal(t, cfg.MaxInFlight, sub.Stats().InFlight, "B still holds every slot")

	release()
	f.waitApplied(t, len(bKeys)+len(aKeys)-1)
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE key = $1", held))
}

// windowOf is partition's Window in s.
func windowOf(s parallel.SubscriberStats, partition int32) int {
	for _, p := range s.Partitions {
		if p.Partition == partition {
			return p.Window
		}
	}
	return -1
}
