package franz

import (
	"context"
	"strconv"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// benchWindow feeds n records over keys keys into one partition's window
// of size window, hands out every ready record and acks them in the order
// handed out: the window's add, release, ack and trim, with no broker.
func benchWindow(b *testing.B, ordering parallel.Ordering, keys, window int) {
	s := &Subscriber{cfg: SubscriberConfig{Ordering: ordering, PartitionWindow: window, MaxInFlight: window}}
	st := &stream{s: s, ctx: context.Background(), wake: make(chan struct{}, 1), parts: map[int32]*part{}}
	keyOf := make([][]byte, keys)
	for i := range keyOf {
		keyOf[i] = []byte("key-" + strconv.Itoa(i))
	}
	recs := make([]*kgo.Record, 4096)
	for i := range recs {
		recs[i] = &kgo.Record{Key: keyOf[i%keys], Offset: int64(i)}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		p := newPart(st, 0)
		st.parts[0] = p
		var flight []*entry
		for _, r := range recs {
			for p.full() {
				e := flight[0]
				flight = flight[1:]
				p.acked(e)
				flight = benchTake(st, flight)
			}
			p.add(r)
			flight = benchTake(st, flight)
		}
		for len(flight) > 0 {
			e := flight[0]
			flight = flight[1:]
			p.acked(e)
			flight = benchTake(st, flight)
		}
		if p.commitOffset() != int64(len(recs)) {
			b.Fatalf("committed %d", p.commitOffset())
		}
		p.end()
	}
}

// benchTake hands out every ready record as the dispatcher would.
func benchTake(st *stream, flight []*entry) []*entry {
	for e := st.pickReady(); e != nil; e = st.pickReady() {
		e.State = keywindow.InFlight
		e.p.inflight++
		flight = append(flight, e)
	}
	return flight
}

func BenchmarkWindowKeys(b *testing.B)      { benchWindow(b, parallel.OrderKey, 64, 256) }
func BenchmarkWindowOneKey(b *testing.B)    { benchWindow(b, parallel.OrderKey, 1, 256) }
func BenchmarkWindowUnordered(b *testing.B) { benchWindow(b, parallel.OrderNone, 64, 256) }
