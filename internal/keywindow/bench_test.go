package keywindow_test

import (
	"strconv"
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// benchWindow reads 4096 records over keys keys into a window of 256,
// hands out every head and acks them in the order handed out.
func benchWindow(b *testing.B, ordering keywindow.Ordering, keys int) {
	keyOf := make([][]byte, keys)
	for i := range keyOf {
		keyOf[i] = []byte("key-" + strconv.Itoa(i))
	}
	b.ReportAllocs()
	for b.Loop() {
		w := keywindow.New[*rec](keywindow.Config{Ordering: ordering, Size: 256}, 0, nil)
		var flight []*rec
		ack := func() {
			r := flight[0]
			flight = flight[1:]
			if next := w.Done(r); next != nil && next.State == keywindow.Waiting {
				next.State = keywindow.InFlight
				flight = append(flight, next)
			}
		}
		for off := range int64(4096) {
			for w.Full() {
				ack()
			}
			w.Read(off)
			r := &rec{}
			if w.Add(r, off, keyOf[int(off)%keys]) {
				r.State = keywindow.InFlight
				flight = append(flight, r)
			}
		}
		for len(flight) > 0 {
			ack()
		}
		if w.CommitOffset() != 4096 {
			b.Fatalf("commit offset %d", w.CommitOffset())
		}
	}
}

func BenchmarkWindowKeys(b *testing.B)      { benchWindow(b, keywindow.ByKey, 64) }
func BenchmarkWindowOneKey(b *testing.B)    { benchWindow(b, keywindow.ByKey, 1) }
func BenchmarkWindowUnordered(b *testing.B) { benchWindow(b, keywindow.Unordered, 64) }
