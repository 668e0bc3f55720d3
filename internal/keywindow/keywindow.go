package keywindow

import (
	"cmp"
	"iter"
	"slices"
)

// Ordering is which earlier records a record waits for.
type Ordering uint8

const (
	// ByKey: a record waits for the earlier records of its key.
	ByKey Ordering = iota
	// ByPartition: a record waits for every earlier record.
	ByPartition
	// Unordered: a record waits for nothing.
	Unordered
)

// State is where a record of the window stands.
type State uint8

const (
	Waiting  State = iota // behind an earlier record of its key
	Held                  // its key's head, waiting for a time of the engine's (NotBeforeFunc)
	Ready                 // queued to be handed out
	InFlight              // handed out, no ack or nack yet
	Backoff               // nacked, waiting to be handed out again
	Done                  // acked (or done before, per the commit metadata)
	Failed                // cannot be handed out: its key and the commit offset stop at it
	Dropped               // its partition was revoked before it was done
	Spilled               // behind an earlier record of its key, payload dropped: read again when it is its key's head
)

// SpillFactor × Size bounds a window's spilled records.
const SpillFactor = 64

// Entry is the window's part of an engine's record type E, which embeds
// it: its offset, key and state, and its link to the next record of its
// key.
type Entry[E any] struct {
	Off   int64
	Key   string // "" unless the window is ByKey
	State State
	next  E // the next record of its key
}

// Elem is an engine's record type: a pointer to a struct embedding
// Entry, whose WindowEntry returns it.
type Elem[E any] interface {
	comparable
	WindowEntry() *Entry[E]
}

// Counts are the records waiting behind their key's head, and of those
// the spilled ones, summed over windows: an engine's gauges, guarded by
// the lock that guards the windows.
type Counts struct{ Waiting, Spilled int }

// chain is the records of one key not done yet, oldest first; only its
// head may be handed out.
type chain[E any] struct {
	head, tail E
	held       int // its waiting records with their payload (not spilled)
}

// Config is a window's.
type Config struct {
	// Ordering is which earlier records a record waits for.
	Ordering Ordering
	// Size is the most records not done (and not spilled) the window
	// holds: [Window.Full] then. It must be positive.
	Size int
}

// Window is one partition's records read and not done, in offset order,
// from the committable offset on.
type Window[E Elem[E]] struct {
	cfg     Config
	counts  *Counts
	entries []E // in offset order; done ones leave (trim)
	undone  int // records of entries not done and not spilled
	spilled int
	waiting int // records behind their key's head, spilled or not
	chains  map[string]*chain[E]
	next    int64 // the offset after the last record read
}

// New returns an empty window whose next record is at offset next (-1,
// or any negative offset, when it is not known yet). counts, when not
// nil, is kept up to date with the window's waiting and spilled records.
func New[E Elem[E]](cfg Config, next int64, counts *Counts) *Window[E] {
	return &Window[E]{cfg: cfg, counts: counts, chains: map[string]*chain[E]{}, next: next}
}

// Read records that the record at offset off was read: it reports false
// for a record below the last one read (read again), to be ignored. A
// record read and not added (done before) still moves the committable
// offset past it when the window is empty.
func (w *Window[E]) Read(off int64) bool {
	if w.next >= 0 && off < w.next {
		return false
	}
	w.next = off + 1
	return true
}

// Add appends e, read (Read) at offset off with record key key, and
// reports whether it is its key's head: the engine releases it (sets it
// Ready, or Held). Otherwise it waits behind its key's head.
func (w *Window[E]) Add(e E, off int64, key []byte) (head bool) {
	x := e.WindowEntry()
	x.Off = off
	w.entries = append(w.entries, e)
	w.undone++
	switch w.cfg.Ordering {
	case Unordered:
		return true
	case ByKey:
		x.Key = string(key)
	}
	c := w.chains[x.Key]
	if c == nil {
		w.chains[x.Key] = &chain[E]{head: e, tail: e}
		return true
	}
	c.tail.WindowEntry().next = e
	c.tail = e
	c.held++
	x.State = Waiting
	w.wait(1)
	return false
}

// Done marks e done: e is its key's head, in flight (or spilled, and
// found gone from Kafka). It returns its key's next record, the new
// head, or the zero E for none: a Waiting one the engine releases, a
// Spilled one it reads again (then Refill), a Dropped one it leaves. The
// done records at the window's front leave it, moving the committable
// offset.
func (w *Window[E]) Done(e E) (next E) {
	x := e.WindowEntry()
	if x.State == Spilled {
		w.spill(-1)
		w.wait(-1)
	} else {
		w.undone--
	}
	x.State = Done
	if w.cfg.Ordering != Unordered {
		c := w.chains[x.Key]
		next = x.next
		x.next = *new(E)
		c.head = next
		switch {
		case next == *new(E):
			delete(w.chains, x.Key)
		case next.WindowEntry().State == Waiting:
			c.held--
			w.wait(-1)
		}
	}
	w.trim()
	return next
}

// trim drops the done records at the front of the window, and the others
// once they are more than the rest.
func (w *Window[E]) trim() {
	n := 0
	for n < len(w.entries) && w.entries[n].WindowEntry().State == Done {
		n++
	}
	if n > 0 {
		clear(w.entries[:n])
		w.entries = w.entries[n:]
	}
	live := w.undone + w.spilled
	if done := len(w.entries) - live; done > live && done > 32 {
		kept := w.entries[:0]
		for _, e := range w.entries {
			if e.WindowEntry().State != Done {
				kept = append(kept, e)
			}
		}
		clear(w.entries[len(kept):])
		w.entries = kept
	}
	if len(w.entries) == 0 {
		w.entries = nil
	}
}

// CommitOffset is the offset below which every record read is done: the
// lowest record not done, or the one after the last record read (negative
// before the first, when New was given no offset).
func (w *Window[E]) CommitOffset() int64 {
	if len(w.entries) > 0 {
		return w.entries[0].WindowEntry().Off
	}
	return w.next
}

// Next is the offset after the last record read.
func (w *Window[E]) Next() int64 { return w.next }

// Full reports whether the window holds Size records not done and not
// spilled.
func (w *Window[E]) Full() bool { return w.undone >= w.cfg.Size }

// Undone is the number of records not done and not spilled.
func (w *Window[E]) Undone() int { return w.undone }

// Spilled is the number of spilled records.
func (w *Window[E]) Spilled() int { return w.spilled }

// Waiting is the number of records behind their key's head.
func (w *Window[E]) Waiting() int { return w.waiting }

// Entries are the window's records, in offset order: those not done, and
// some done ones (they leave in batches). The slice is the window's: not
// to be kept or changed.
func (w *Window[E]) Entries() []E { return w.entries }

// Find returns the window's record at offset off.
func (w *Window[E]) Find(off int64) (E, bool) {
	i, ok := slices.BinarySearchFunc(w.entries, off, func(e E, off int64) int { return cmp.Compare(e.WindowEntry().Off, off) })
	if !ok {
		return *new(E), false
	}
	return w.entries[i], true
}

// IsHead reports whether e is its key's head.
func (w *Window[E]) IsHead(e E) bool {
	if w.cfg.Ordering == Unordered {
		return true
	}
	c := w.chains[e.WindowEntry().Key]
	return c != nil && c.head == e
}

// Blocking yields the heads of the keys that have records waiting behind
// them with their payload.
func (w *Window[E]) Blocking() iter.Seq[E] {
	return func(yield func(E) bool) {
		for _, c := range w.chains {
			if c.held > 0 && !yield(c.head) {
				return
			}
		}
	}
}

// Stop drops the records not in flight, not done and not failed (the
// partition was revoked): f, when not nil, sees each first, in its state
// before (to stop its timers). The waiting and spilled counts go to zero.
func (w *Window[E]) Stop(f func(E)) {
	for _, e := range w.entries {
		x := e.WindowEntry()
		switch x.State {
		case Waiting, Held, Ready, Backoff, Spilled:
		default:
			continue
		}
		if f != nil {
			f(e)
		}
		x.State = Dropped
	}
	w.wait(-w.waiting)
	w.spill(-w.spilled)
}

// Release forgets the window's records, and unlinks each from the next
// of its key: the partition is gone, and a record still in flight must
// not keep the records behind it.
func (w *Window[E]) Release() {
	for _, e := range w.entries {
		e.WindowEntry().next = *new(E)
	}
	clear(w.entries)
	w.entries, w.chains = nil, nil
}

func (w *Window[E]) wait(n int) {
	w.waiting += n
	if w.counts != nil {
		w.counts.Waiting += n
	}
}

func (w *Window[E]) spill(n int) {
	w.spilled += n
	if w.counts != nil {
		w.counts.Spilled += n
	}
}
