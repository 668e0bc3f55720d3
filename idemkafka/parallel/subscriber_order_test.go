package parallel_test

import (
	"encoding/json"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A backlog whose keys all move, each far longer than the window: the
// window fills with records waiting behind heads that are acked in turn,
// and every record is applied once, each key in order. A moving key is not
// spilled (its records would be read twice for nothing); whether a head
// counts as moving depends on time, so the records read again (a head
// stalled by a loaded machine may count as slow) are logged, not held to
// a bound: the bench's head-of-line section measures the rule.
func TestSubscriberDrainsAMovingBacklog(t *testing.T) {
	const keys, perKey = 4, 250
	f := newFixture(t, 1, 4)
	f.produce(t, keys, perKey)
	cfg := f.config("moving")
	cfg.PartitionWindow = 20
	sub := f.subscriber(t, cfg)
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(nil))
	f.waitApplied(t, keys*perKey)
	f.verifyLedger(t, keys, perKey)
	t.Logf("records read again: %d of %d", sub.Stats().Refetched, keys*perKey)
}

// With OrderPartition nothing is spilled: reading on would find only
// records waiting behind the same head. A failing head fills the window,
// the partition's fetching pauses, and once the head heals every record is
// applied in order.
func TestSubscriberOrderPartitionSpillsNothing(t *testing.T) {
	const n = 30
	f := newFixture(t, 1, 4)
	f.produce(t, n, 1)
	var healed atomic.Bool
	cfg := f.config("partition")
	cfg.Ordering = parallel.OrderPartition
	cfg.PartitionWindow = 5
	sub := f.subscriber(t, cfg)
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev == (event{keyName(0), 1}) && !healed.Load() {
			return errStuck
		}
		return nil
	}))
	waitFor(t, "the failing head nacked with a full window", func() bool {
		s := sub.Stats()
		return s.Nacked >= 3 && len(s.Partitions) == 1 && s.Partitions[0].Window == 5
	})
	s := sub.Stats()
	require.Zero(t, s.Spilled)
	require.Zero(t, s.Refetched)
	require.Equal(t, 4, s.KeysWaiting)
	healed.Store(true)
	f.waitApplied(t, n)
	f.verifyLedger(t, n, 1)
	require.Zero(t, sub.Stats().Refetched)
}

// keyless is the seq-th event of a record without a Kafka key (no
// partition key metadata); its payload names the key "none".
func (f *fixture) keyless(t *testing.T, seq int) *message.Message {
	t.Helper()
	b, err := json.Marshal(event{Key: "none", Seq: seq})
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7()).String()
	m := message.NewMessage(id, b)
	m.Metadata.Set(publisher.MetadataEventID, id)
	return m
}

// Under OrderKey the records without a key are one key of their own in
// their partition: a failing one holds the later keyless records (applied
// after it, in order), not the keyed ones.
func TestSubscriberKeylessRecordsAreOneKey(t *testing.T) {
	const n = 20
	f := newFixture(t, 1, 4)
	msgs := []*message.Message{}
	for i := 1; i <= n; i++ {
		msgs = append(msgs, f.keyless(t, i), f.event(t, keyName(i), 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	var healed atomic.Bool
	sub := f.subscriber(t, f.config("keyless"))
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev == (event{"none", 1}) && !healed.Load() {
			return errStuck
		}
		return nil
	}))
	f.waitApplied(t, n)
	waitFor(t, "the keyless records to wait behind the first", func() bool { return sub.Stats().KeysWaiting == n-1 })
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE key = 'none'"), "no keyless record passed the failing one")
	healed.Store(true)
	f.waitApplied(t, 2*n)
	want := map[string]int{"none": n}
	for i := 1; i <= n; i++ {
		want[keyName(i)] = 1
	}
	f.verifyLedgerKeys(t, want)
}

// With OrderNone nothing waits for anything: the later records of a key
// whose first record fails are applied meanwhile.
func TestSubscriberOrderNoneOrdersNothing(t *testing.T) {
	f := newFixture(t, 1, 4)
	msgs := []*message.Message{}
	for i := 1; i <= 5; i++ {
		msgs = append(msgs, f.event(t, "a", i))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	var healed atomic.Bool
	cfg := f.config("none")
	cfg.Ordering = parallel.OrderNone
	sub := f.subscriber(t, cfg)
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev == (event{"a", 1}) && !healed.Load() {
			return errStuck
		}
		return nil
	}))
	f.waitApplied(t, 4)
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE seq = 1"))
	require.Zero(t, sub.Stats().KeysWaiting)
	healed.Store(true)
	f.waitApplied(t, 5)
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE seq = 1"))
}
