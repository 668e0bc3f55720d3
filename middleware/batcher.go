package middleware

import (
	"slices"
	"sync"
)

// batcher runs items in batches without a goroutine of its own: the caller
// whose item is queued and who gets one of the slots leads a batch of the
// oldest queued items (at most max), runs it, and frees the slot. Items
// gather only while every slot is busy, so a lone item waits for nothing.
// run must close every item's done channel, also when it fails, and call
// release once, when the batch no longer needs its slot (it may hold it
// past its return: the fast path's transaction stays open while its
// handlers run).
type batcher[T any] struct {
	max   int
	slots chan struct{}
	run   func(batch []*T, release func())

	mu    sync.Mutex
	queue []*T
}

func newBatcher[T any](max, concurrency int, run func(batch []*T, release func())) *batcher[T] {
	return &batcher[T]{max: max, slots: make(chan struct{}, concurrency), run: run}
}

// do queues item and returns once done is closed.
func (b *batcher[T]) do(item *T, done <-chan struct{}) {
	b.mu.Lock()
	b.queue = append(b.queue, item)
	b.mu.Unlock()
	for {
		select {
		case <-done:
			return
		case b.slots <- struct{}{}:
		}
		b.mu.Lock()
		if !slices.Contains(b.queue, item) {
			// Another leader runs it: wait for that, leaving the slot free.
			b.mu.Unlock()
			<-b.slots
			<-done
			return
		}
		n := min(len(b.queue), b.max)
		batch := slices.Clone(b.queue[:n])
		b.queue = slices.Delete(b.queue, 0, n)
		b.mu.Unlock()
		var once sync.Once
		release := func() { once.Do(func() { <-b.slots }) }
		func() {
			defer func() {
				if p := recover(); p != nil {
					release()
					panic(p)
				}
			}()
			b.run(batch, release)
		}()
	}
}
