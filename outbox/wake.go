package outbox

import "sync"

// wakers carries a hint from this process's writers to its forwarders: a
// write to a topic's table ends the sleep of every forwarder loop of this
// process that forwards that table, so that a row committed between two
// polls is read within a few milliseconds instead of after the loop's idle
// wait. It is keyed by the messages table's qualified name, so it works
// whichever *Outbox values the writer and the forwarder were built from; a
// forwarder of the same table name in another database gets a needless
// wake-up, which costs it one poll. Forwarders in other processes do not
// hear it: they poll, or Listen.
var wakers = wakeHub{byTable: map[string][]chan struct{}{}}

type wakeHub struct {
	mu      sync.RWMutex
	byTable map[string][]chan struct{}
}

// add makes a write to table send to ch (without blocking: ch has a buffer
// of one, and a pending hint is enough) until remove is called.
func (h *wakeHub) add(table string, ch chan struct{}) (remove func()) {
	h.mu.Lock()
	h.byTable[table] = append(h.byTable[table], ch)
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		chs := h.byTable[table]
		for i, c := range chs {
			if c == ch {
				chs = append(chs[:i:i], chs[i+1:]...)
				break
			}
		}
		if len(chs) == 0 {
			delete(h.byTable, table)
		} else {
			h.byTable[table] = chs
		}
	}
}

// wake hints every loop of table.
func (h *wakeHub) wake(table string) {
	h.mu.RLock()
	defer h.mu.RUnlock()
	for _, ch := range h.byTable[table] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}
