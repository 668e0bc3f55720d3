package bench

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("rebalance-heap", rebalanceHeap) }

// The rebalance-heap workload: every key of the topic fails forever with a
// NackResendSleep of an hour, so each key's head waits on its back-off
// timer and its later records wait behind it, payloads in the window.
const (
	rbPartitions = 8
	rbRebalances = 10
	rbBackoff    = time.Hour
)

// rbMember is one group member: a parallel Subscriber whose every message
// is nacked.
type rbMember struct {
	sub    *parallel.Subscriber
	cancel context.CancelFunc
	done   chan struct{}
}

func (m *rbMember) close() {
	m.cancel()
	_ = m.sub.Close()
	<-m.done
}

// rbRig is a broker with one topic of records all failing forever.
type rbRig struct {
	brokers []string
	topic   string
	records int
	keys    int
	seq     atomic.Int64
}

func (r *rbRig) member(ctx context.Context, group string) (*rbMember, error) {
	sc := sarama.NewConfig()
	// A member learns of a rebalance at its next heartbeat: 10 rebalances
	// at Sarama's default of 3 s would take minutes.
	sc.Consumer.Group.Heartbeat.Interval = 300 * time.Millisecond
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client: idemkafka.ClientConfig{Brokers: r.brokers, Sarama: sc}, ConsumerGroup: group, NackResendSleep: rbBackoff,
	}, nil)
	if err != nil {
		return nil, err
	}
	mctx, cancel := context.WithCancel(ctx)
	ch, err := sub.Subscribe(mctx, r.topic)
	if err != nil {
		cancel()
		_ = sub.Close()
		return nil, err
	}
	m := &rbMember{sub: sub, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for msg := range ch {
			msg.Nack()
		}
	}()
	return m, nil
}

// settle waits until the members hold every partition, every record read
// into their windows, every key's head backing off (none in flight), and
// each has set up a session since sessions[i].
func (r *rbRig) settle(ctx context.Context, members []*rbMember, sessions []uint64) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		parts, window, waiting, inflight, fresh := 0, 0, 0, 0, true
		for i, m := range members {
			st := m.sub.Stats()
			parts += len(st.Partitions)
			for _, p := range st.Partitions {
				window += p.Window
			}
			waiting += st.KeysWaiting
			inflight += st.InFlight
			fresh = fresh && st.Sessions > sessions[i]
		}
		if fresh && parts == rbPartitions && window == r.records && waiting == r.records-r.keys && inflight == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: rebalance-heap: not settled after 2 minutes (%d partitions, %d records in windows, %d waiting, %d in flight)",
				parts, window, waiting, inflight)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// liveHeap is the heap in use after two full collections.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// sessionsOf is each member's Stats().Sessions now.
func sessionsOf(members ...*rbMember) []uint64 {
	out := make([]uint64, len(members))
	for i, m := range members {
		out[i] = m.sub.Stats().Sessions
	}
	return out
}

// round measures the heap with member A alone and settled, before and
// after rbRebalances rebalances: a second member B joins (one), then
// leaves (another), rbRebalances/2 times.
func (r *rbRig) round(ctx context.Context) (before, after uint64, err error) {
	group := fmt.Sprintf("bench-rebalance-%d", r.seq.Add(1))
	a, err := r.member(ctx, group)
	if err != nil {
		return 0, 0, err
	}
	defer a.close()
	if err := r.settle(ctx, []*rbMember{a}, []uint64{0}); err != nil {
		return 0, 0, err
	}
	before = liveHeap()
	for range rbRebalances / 2 {
		s := sessionsOf(a)
		b, err := r.member(ctx, group)
		if err != nil {
			return 0, 0, err
		}
		if err := r.settle(ctx, []*rbMember{a, b}, append(s, 0)); err != nil {
			b.close()
			return 0, 0, err
		}
		s = sessionsOf(a)
		b.close()
		if err := r.settle(ctx, []*rbMember{a}, s); err != nil {
			return 0, 0, err
		}
	}
	return before, liveHeap(), nil
}

func (r *rbRig) produce(payload int) error {
	p, err := sarama.NewSyncProducer(r.brokers, idemkafka.SaramaProducerConfig(nil))
	if err != nil {
		return err
	}
	defer p.Close()
	body := []byte(strings.Repeat("x", payload))
	var batch []*sarama.ProducerMessage
	for i := range r.records {
		msg := message.NewMessage(uuid.NewString(), body)
		publisher.WithPartitionKey(msg, "key-"+strconv.Itoa(i%r.keys))
		pm, err := idemkafka.Marshaler{}.Marshal(r.topic, msg)
		if err != nil {
			return err
		}
		if batch = append(batch, pm); len(batch) == 200 || i == r.records-1 {
			if err := p.SendMessages(batch); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	return nil
}

func rebalanceHeap(ctx context.Context, o Options) (Section, error) {
	records, keys, payload, rounds := 2048, 256, 4096, min(o.Rounds, 3)
	if o.Short {
		records, keys, payload, rounds = 512, 64, 4096, 1
	}
	r := &rbRig{brokers: o.Brokers, records: records, keys: keys}
	if len(r.brokers) == 0 {
		c, err := kafkatest.NewFake()
		if err != nil {
			return Section{}, fmt.Errorf("start kfake: %w", err)
		}
		defer c.Close()
		r.brokers = c.ListenAddrs()
	}
	r.topic = "bench-rebalance-" + uuid.NewString()[:8]
	if err := kafkatest.CreateTopic(r.brokers, r.topic, rbPartitions); err != nil {
		return Section{}, err
	}
	if err := r.produce(payload); err != nil {
		return Section{}, err
	}
	var befores, afters, ratios []float64
	for i := range rounds {
		before, after, err := r.round(ctx)
		if err != nil {
			return Section{}, err
		}
		o.Logf("  rebalance-heap round %d: heap %s before, %s after %d rebalances", i+1, mib(int64(before)), mib(int64(after)), rbRebalances)
		befores, afters = append(befores, float64(before)), append(afters, float64(after))
		ratios = append(ratios, float64(after)/float64(before))
	}
	st := Summarise(ratios)
	row := []string{
		fmt.Sprintf("%d rebalances with hour-long back-offs pending", rbRebalances),
		"heap after GC, after the rebalances", "heap after GC, before them",
		mib(int64(Summarise(befores).Median)), mib(int64(Summarise(afters).Median)),
		st.String(), fmt.Sprintf("≤ 1.2×: %s", pass(st.Max <= 1.2)),
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workload", "subject", "baseline", "baseline heap (median)", "subject heap (median)", "ratio to baseline", "target"}, [][]string{row}))
	fmt.Fprintf(&b, "\nOne parallel Subscriber (member A; defaults, NackResendSleep %s, heartbeat every 300 ms) consumes a topic of %d partitions "+
		"(%s) holding %d records of %d B over %d keys, and nacks every message: each key's head waits on its hour-long back-off "+
		"timer, its later records wait behind it, so the windows hold every record with its payload. Once that is settled, the process's "+
		"heap in use after two runtime.GC() calls (HeapAlloc; the in-process broker's copy of the records included, the same before and "+
		"after); then %d rebalances: a second member joins (every partition is revoked and assigned again, eagerly: both members read "+
		"their records again and back off anew) and leaves again, each time settled the same way; then the heap again, with A alone "+
		"holding every partition. A revoked window that stayed in memory until its timers fired would add one copy of the records per "+
		"rebalance. %d round(s), a new consumer group each; the target holds for the worst round.\n",
		rbBackoff, rbPartitions, kafkaDesc(o.Brokers), records, payload, keys, rbRebalances, rounds)
	return Section{Title: "Parallel subscriber (idemkafka): memory across rebalances with back-offs pending", Markdown: b.String()}, nil
}
