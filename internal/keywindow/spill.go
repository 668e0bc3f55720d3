package keywindow

// Load is what the starvation rule ([Starved]) looks at.
type Load struct {
	// Ready: the partition has a ready record of its own.
	Ready bool
	// InFlight is the partition's records in flight.
	InFlight int
	// Partitions is the number of partitions sharing MaxInFlight (at
	// least one counts).
	Partitions int
	// Total is the records in flight across them all, MaxInFlight their
	// bound.
	Total, MaxInFlight int
}

// Starved reports whether spilling a full partition's blocked keys could
// give a handler work: the partition has no ready record of its own, and
// it has fewer records in flight than its share of MaxInFlight (the next
// freed slots go to it), or a MaxInFlight slot is free with no ready
// record of any partition queued for it (othersReady, asked only then).
// Otherwise the handlers hold the partition up, not its blocked keys:
// with a backlog a window holds far more ready heads than MaxInFlight,
// and spilling would only read records twice.
func Starved(l Load, othersReady func() bool) bool {
	if l.Ready {
		return false
	}
	share := max(l.MaxInFlight/max(l.Partitions, 1), 1)
	return l.InFlight < share || l.Total < l.MaxInFlight && !othersReady()
}

// SpillRoom reports whether the window may spill more records (at most
// SpillFactor × Size).
func (w *Window[E]) SpillRoom() bool { return w.spilled < SpillFactor*w.cfg.Size }

// Spill drops the payloads of waiting records of blocked keys (blocked
// says whether a key's head holds it up) until a quarter of the window is
// free, as far as the spill bound allows: those of the blocked key with
// the most waiting records first, the latest first. drop sees each
// spilled record: the engine drops its payload. They stay in the window
// (the committable offset counts them as not done) and in their key's
// chain, but not in Size, and are read again when they become their key's
// head (Done returns them, Refill puts them back). It spills nothing but
// ByKey: with ByPartition reading on would find only records waiting
// behind the same head; the engine calls it only when the partition is
// starved ([Starved]). It reports whether it freed room.
func (w *Window[E]) Spill(blocked func(head E) bool, drop func(E)) bool {
	if w.cfg.Ordering != ByKey {
		return false
	}
	target := w.cfg.Size - max(w.cfg.Size/4, 1)
	freed := false
	for w.undone > target && w.SpillRoom() {
		var key string
		var most *chain[E]
		for k, c := range w.chains {
			if c.held > 0 && (most == nil || c.held > most.held) && blocked(c.head) {
				key, most = k, c
			}
		}
		if most == nil {
			break
		}
		for i := len(w.entries) - 1; i >= 0 && most.held > 0 && w.undone > target && w.SpillRoom(); i-- {
			e := w.entries[i]
			x := e.WindowEntry()
			if x.State != Waiting || x.Key != key {
				continue
			}
			x.State = Spilled
			drop(e)
			most.held--
			w.undone--
			w.spill(1)
			freed = true
		}
	}
	return freed
}

// Refill puts back e, a spilled record read again: always when it is its
// key's head (head: the engine releases it), else while the window has
// room (it waits as before). ok is false when e stays spilled.
func (w *Window[E]) Refill(e E) (head, ok bool) {
	x := e.WindowEntry()
	if x.State != Spilled {
		return false, false
	}
	head = w.IsHead(e)
	if !head && w.Full() {
		return false, false
	}
	w.spill(-1)
	w.undone++
	if head {
		w.wait(-1)
		return true, true
	}
	x.State = Waiting
	w.chains[x.Key].held++
	return false, true
}
