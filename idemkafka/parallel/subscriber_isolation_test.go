package parallel_test

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

// stallLog records the Subscriber's "Key stalled" log lines.
type stallLog struct {
	watermill.NopLogger
	mu     *sync.Mutex
	lines  *[]stallLine
	fields watermill.LogFields
}

type stallLine struct {
	msg    string
	err    error
	fields watermill.LogFields
}

func newStallLog() *stallLog { return &stallLog{mu: &sync.Mutex{}, lines: &[]stallLine{}} }

func (l *stallLog) Error(msg string, err error, fields watermill.LogFields) {
	if !strings.HasPrefix(msg, "Key stalled") {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.lines = append(*l.lines, stallLine{msg, err, l.fields.Copy().Add(fields)})
}

func (l *stallLog) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &stallLog{mu: l.mu, lines: l.lines, fields: l.fields.Copy().Add(fields)}
}

// of returns the lines about key.
func (l *stallLog) of(key string) []stallLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []stallLine
	for _, line := range *l.lines {
		if line.fields["key"] == key {
			out = append(out, line)
		}
	}
	return out
}

// stallOf returns the stall of key in s.
func stallOf(s parallel.SubscriberStats, key string) (parallel.Stall, bool) {
	for _, st := range s.Stalls {
		if st.Key == key {
			return st, true
		}
	}
	return parallel.Stall{}, false
}

var errStuck = errors.New("stuck fails")

// A key whose head fails forever (no retry topic, no poison queue,
// in-process retries spent) holds its own later records and the committed
// offset, not its partition: 3,000 records of 300 other keys behind it on
// the same partition, about three PartitionWindows, are all applied, each
// key in order. The key shows as stalled, failing, with its last error, in
// Stats and in one log line.
func TestSubscriberFailingKeyDoesNotStopItsPartition(t *testing.T) {
	const keys, perKey = 300, 10
	f := newFixture(t, 1, 8)
	f.outer = []message.HandlerMiddleware{parallel.RecordErrors}
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "stuck", 1)))
	f.produce(t, keys, perKey)
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "stuck", 2), f.event(t, "stuck", 3)))

	cfg := f.config("failing")
	// Long enough that no failing attempt (BEGIN, claim, handler, ROLLBACK)
	// runs that long on a loaded machine: such an attempt is a slow head
	// when the stall is first seen, and its log line says "slow".
	cfg.StallTimeout = 3 * time.Second
	log := newStallLog()
	sub, err := parallel.NewSubscriber(cfg, log)
	require.NoError(t, err)
	f.router(t, sub, f.db.Pool, 1, nil, ledgerHandler(func(ev event) error {
		if ev.Key == "stuck" {
			return errStuck
		}
		return nil
	}))
	f.waitApplied(t, keys*perKey)
	want := map[string]int{}
	for k := range keys {
		want[keyName(k)] = perKey
	}
	f.verifyLedgerKeys(t, want)

	waitFor(t, "the stuck key stalled, failing, in Stats", func() bool {
		st, ok := stallOf(sub.Stats(), "stuck")
		return ok && st.Cause == parallel.StallFailing && st.Nacks > 0 && st.LastError != nil
	})
	s := sub.Stats()
	st, _ := stallOf(s, "stuck")
	require.ErrorContains(t, st.LastError, errStuck.Error())
	require.Equal(t, int64(0), st.Offset)
	require.Equal(t, 1, s.StalledKeys, "only the stuck key: the others are done")
	require.Equal(t, int64(0), s.Partitions[0].Committed, "the committed offset stays at the failing head")
	require.Equal(t, 3, s.Partitions[0].Window+s.Spilled, "the window holds only what is not done: the stuck key's three records (its two waiting ones may be spilled: it failed while the window was full)")
	require.Equal(t, 2, s.KeysWaiting)
	waitFor(t, "the done records in the commit metadata", func() bool {
		off, meta := f.committed(t, "failing")
		return off == 0 && meta != ""
	})
	waitFor(t, "the stall's log line", func() bool { return len(log.of("stuck")) > 0 })
	lines := log.of("stuck")
	require.Len(t, lines, 1, "one line per stall")
	require.Equal(t, "failing", lines[0].fields["cause"])
	require.ErrorContains(t, lines[0].err, errStuck.Error())
	require.Equal(t, int64(0), lines[0].fields["kafka_partition_offset"])
}

// A hot key whose head's handler runs long (held here until the others are
// done) does not hold its partition: 3,000 records of other keys behind
// its 30 records are all applied while it runs. It shows as stalled, slow,
// in Stats and in one log line; once it returns, its records follow in
// order.
func TestSubscriberSlowKeyDoesNotHoldItsPartition(t *testing.T) {
	const keys, perKey, hot = 300, 10, 30
	f := newFixture(t, 1, 8)
	var msgs []*message.Message
	for i := 1; i <= hot; i++ {
		msgs = append(msgs, f.event(t, "hot", i))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	f.produce(t, keys, perKey)

	cfg := f.config("slow")
	cfg.StallTimeout = 500 * time.Millisecond
	log := newStallLog()
	sub, err := parallel.NewSubscriber(cfg, log)
	require.NoError(t, err)
	g := newGate()
	hot1 := event{"hot", 1}
	g.block(hot1)
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev == hot1 {
			<-g.ch(hot1)
		}
		return nil
	}))
	t.Cleanup(g.releaseAll)
	f.waitApplied(t, keys*perKey)
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE key = 'hot'"))

	waitFor(t, "the hot key stalled, slow, in Stats", func() bool {
		st, ok := stallOf(sub.Stats(), "hot")
		return ok && st.Cause == parallel.StallSlow
	})
	s := sub.Stats()
	st, _ := stallOf(s, "hot")
	require.Equal(t, int64(0), st.Offset)
	require.Positive(t, st.Running)
	require.Equal(t, hot, s.Partitions[0].Window+s.Spilled, "the hot key's records, in the window or spilled")
	require.Equal(t, hot-1, s.KeysWaiting)
	waitFor(t, "the stall's log line", func() bool { return len(log.of("hot")) > 0 })
	lines := log.of("hot")
	require.Len(t, lines, 1)
	require.Equal(t, "slow", lines[0].fields["cause"])
	require.Contains(t, lines[0].fields, "running")
	require.ErrorContains(t, lines[0].err, "its handler running")

	g.release(hot1)
	f.waitApplied(t, keys*perKey+hot)
	want := map[string]int{"hot": hot}
	for k := range keys {
		want[keyName(k)] = perKey
	}
	f.verifyLedgerKeys(t, want)
	waitFor(t, "no stall", func() bool { return sub.Stats().StalledKeys == 0 })
}

// With a key failing on each partition, a second member joins mid-way
// (a rebalance), then the first leaves (another), and the keys heal only
// after that: every event is applied once, each key in order. The next
// owner of a partition starts at the failing head (the committed offset)
// and skips the records done above it per the commit metadata: under
// cooperative-sticky too, where the second member gets its partitions
// mid-session (no Setup for them).
func TestSubscriberFailingKeysAcrossRebalances(t *testing.T) {
	t.Run("eager", func(t *testing.T) { failingKeysAcrossRebalances(t, false) })
	t.Run("cooperative", func(t *testing.T) { failingKeysAcrossRebalances(t, true) })
}

func failingKeysAcrossRebalances(t *testing.T, coop bool) {
	const keys, perKey = 60, 20
	const total = keys * perKey
	f := newFixture(t, 2, 8)
	f.outer = []message.HandlerMiddleware{parallel.RecordErrors}
	// "stuck-*" keys spread over both partitions (the marshaler hashes the key).
	var stuck []string
	var first, later []*message.Message
	for i := range 8 {
		k := "stuck-" + keyName(i)
		stuck = append(stuck, k)
		first = append(first, f.event(t, k, 1))
		later = append(later, f.event(t, k, 2), f.event(t, k, 3))
	}
	require.NoError(t, f.pub.Publish(f.topic, first...))
	f.produce(t, keys, perKey/2)
	require.NoError(t, f.pub.Publish(f.topic, later...))
	f.produceSeqs(t, keys, perKey/2+1, perKey)

	var healed atomic.Bool
	handler := ledgerHandler(func(ev event) error {
		if strings.HasPrefix(ev.Key, "stuck-") && !healed.Load() {
			return errStuck
		}
		return nil
	})
	cfg := f.config("rebalance")
	if coop {
		cfg = cooperative(cfg)
	}
	a := f.subscriber(t, cfg)
	stopA := f.router(t, a, f.db.Pool, 0, nil, handler)
	f.waitApplied(t, total/3)
	b := f.subscriber(t, cfg)
	f.router(t, b, f.db.Pool, 0, nil, handler)
	waitFor(t, "the rebalance", func() bool { return len(b.Stats().Partitions) > 0 && len(a.Stats().Partitions) < 2 })
	f.waitApplied(t, 2*total/3)
	stopA()
	f.waitApplied(t, total)
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE key LIKE 'stuck-%'"))
	healed.Store(true)
	f.waitApplied(t, total+3*len(stuck))
	want := map[string]int{}
	for k := range keys {
		want[keyName(k)] = perKey
	}
	for _, k := range stuck {
		want[k] = 3
	}
	f.verifyLedgerKeys(t, want)
	require.Positive(t, b.Stats().Skipped, "the next owner skipped records done above the committed offset")
	if coop {
		require.Equal(t, uint64(1), b.Stats().Sessions, "b got its partitions mid-session")
	}
}

// spillBacklog publishes, on the fixture's single partition, stuck's first
// event, then 100 more of it interleaved with one event of each of 100
// other keys, and returns the ledger every key ends with.
func (f *fixture) spillBacklog(t *testing.T) map[string]int {
	t.Helper()
	msgs := []*message.Message{f.event(t, "stuck", 1)}
	for i := range 100 {
		msgs = append(msgs, f.event(t, "stuck", i+2), f.event(t, keyName(i), 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	want := map[string]int{"stuck": 101}
	for k := range 100 {
		want[keyName(k)] = 1
	}
	return want
}

// A failing key whose own backlog is larger than the window: its waiting
// records' payloads are dropped (spilled) to make room, so the other keys'
// records behind them are all applied; the window never holds more than
// PartitionWindow records not done, and the committed offset stays at the
// failing head. Once the key heals, its spilled records are read again
// from Kafka in turn: all applied once, in order (heal in place), and
// after a restart the next owner reads them from the committed offset
// (heal after a restart).
func TestSubscriberSpillsAFailingKeysBacklog(t *testing.T) {
	for _, restart := range []bool{false, true} {
		name := "heal in place"
		if restart {
			name = "heal after a restart"
		}
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, 1, 4)
			want := f.spillBacklog(t)
			var healed atomic.Bool
			handler := ledgerHandler(func(ev event) error {
				if ev.Key == "stuck" && !healed.Load() {
					return errStuck
				}
				return nil
			})
			cfg := f.config("spill")
			cfg.PartitionWindow = 4
			errs := &errorLog{}
			sub, err := parallel.NewSubscriber(cfg, errs)
			require.NoError(t, err)
			stop := f.router(t, sub, f.db.Pool, 0, nil, handler)
			f.waitApplied(t, 100)
			require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE key = 'stuck'"))
			s := sub.Stats()
			require.Positive(t, s.Spilled)
			require.Equal(t, 100, s.KeysWaiting, "stuck's 100 later records wait, spilled or not")
			require.LessOrEqual(t, s.Partitions[0].Window, 4)
			require.Equal(t, int64(0), s.Partitions[0].Committed)
			if restart {
				stop()
				sub = f.subscriber(t, cfg)
				healed.Store(true)
				f.router(t, sub, f.db.Pool, 0, nil, handler)
			} else {
				healed.Store(true)
			}
			f.waitApplied(t, 201)
			f.verifyLedgerKeys(t, want)
			require.Empty(t, errs.messages(), "no pass reading spilled records again failed (one refused while the previous pass's consumer closed waited a second)")
			waitFor(t, "nothing spilled or waiting", func() bool {
				s := sub.Stats()
				return s.Spilled == 0 && s.KeysWaiting == 0 && s.Partitions[0].Window == 0
			})
		})
	}
}

// errorLog records the messages the Subscriber logs as errors.
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	msgs []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msg+": "+err.Error())
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errorLog) messages() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.msgs)
}

// badKeyUnmarshaler refuses the records of key "bad".
type badKeyUnmarshaler struct{ idemkafka.Marshaler }

var errBadRecord = errors.New("this record cannot be unmarshalled")

func (u badKeyUnmarshaler) Unmarshal(m *sarama.ConsumerMessage) (*message.Message, error) {
	if string(m.Key) == "bad" {
		return nil, errBadRecord
	}
	return u.Marshaler.Unmarshal(m)
}

// A record that cannot be unmarshalled stops its key and the committed
// offset, not its partition: the other keys' records behind it are
// applied, and the key shows as a failing stall with the unmarshal error.
func TestSubscriberUnmarshalFailureStopsOnlyItsKey(t *testing.T) {
	const keys = 50
	f := newFixture(t, 1, 4)
	require.NoError(t, f.pub.Publish(f.topic, f.event(t, "bad", 1)))
	f.produce(t, keys, 2)
	cfg := f.config("unmarshal")
	cfg.Unmarshaler = badKeyUnmarshaler{}
	cfg.StallTimeout = 500 * time.Millisecond
	sub := f.subscriber(t, cfg)
	f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(nil))
	f.waitApplied(t, keys*2)
	want := map[string]int{}
	for k := range keys {
		want[keyName(k)] = 2
	}
	f.verifyLedgerKeys(t, want)
	waitFor(t, "the bad key stalled, failing", func() bool {
		st, ok := stallOf(sub.Stats(), "bad")
		return ok && st.Cause == parallel.StallFailing && errors.Is(st.LastError, errBadRecord)
	})
	require.Equal(t, int64(0), sub.Stats().Partitions[0].Committed)
}
