package parallel

import (
	"strconv"
	"testing"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// benchWindow feeds n records over keys keys into one partition's window
// of size window, hands out every ready record and acks them in the order
// handed out: the window's add, release, ack and trim, with no broker.
func benchWindow(b *testing.B, ordering Ordering, keys, window int) {
	s := &Subscriber{cfg: SubscriberConfig{Ordering: ordering, PartitionWindow: window, MaxInFlight: window}}
	st := &stream{s: s, wake: make(chan struct{}, 1), parts: map[int32]*partState{}}
	keyOf := make([][]byte, keys)
	for i := range keyOf {
		keyOf[i] = []byte("key-" + strconv.Itoa(i))
	}
	msgs := make([]*sarama.ConsumerMessage, 4096)
	for i := range msgs {
		msgs[i] = &sarama.ConsumerMessage{Key: keyOf[i%keys], Offset: int64(i)}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		p := &partState{st: st, win: keywindow.New[*entry](keywindow.Config{Ordering: windowOrdering(ordering), Size: window}, 0, &s.stats.keys), highest: -1, marked: -1,
			space: make(chan struct{}, 1), drained: make(chan struct{}, 1)}
		st.parts[0] = p
		var flight []*entry
		for _, m := range msgs {
			for p.full() {
				e := flight[0]
				flight = flight[1:]
				p.acked(e)
				flight = benchTake(st, flight)
			}
			p.add(m)
			flight = benchTake(st, flight)
		}
		for len(flight) > 0 {
			e := flight[0]
			flight = flight[1:]
			p.acked(e)
			flight = benchTake(st, flight)
		}
		if p.commitOffset() != int64(len(msgs)) {
			b.Fatalf("committed %d", p.commitOffset())
		}
	}
}

// benchTake hands out every ready record as the dispatcher would.
func benchTake(st *stream, flight []*entry) []*entry {
	for e := st.pickReady(); e != nil; e = st.pickReady() {
		e.State = keywindow.InFlight
		e.p.inflight++
		st.s.stats.inflight++
		flight = append(flight, e)
	}
	return flight
}

func BenchmarkWindowKeys(b *testing.B)      { benchWindow(b, OrderKey, 64, 256) }
func BenchmarkWindowOneKey(b *testing.B)    { benchWindow(b, OrderKey, 1, 256) }
func BenchmarkWindowUnordered(b *testing.B) { benchWindow(b, OrderNone, 64, 256) }
