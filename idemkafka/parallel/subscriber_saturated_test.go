package parallel_test

import (
	"testing"
	"time"

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

	waitFor(t, "every head stalled, running or queued", func() bool {
		s := sub.Stats()
		return s.StalledKeys == keys && s.InFlight == cfg.MaxInFlight
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
