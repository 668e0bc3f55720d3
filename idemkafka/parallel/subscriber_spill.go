package parallel

import (
	"cmp"
	"slices"
	"time"

	"github.com/IBM/sarama"
)

// spill drops the payloads of waiting records of blocked keys until a
// quarter of the window is free, as far as the spill bound allows: those
// of the blocked key with the most waiting records first, the latest
// first. They stay in the window (the committed offset and the commit
// metadata count them as not done) and in their key's chain, but not in
// PartitionWindow, and are read again from Kafka when they become their
// key's head. A key whose head moves is not spilled: its records would be
// read twice for nothing, and the window's back-pressure is right for it.
// Nothing is spilled with OrderPartition (reading on would find only
// records waiting behind the same head), nor when reading on would give
// no handler work (partState.starved). It reports whether it freed room.
// Called with mu held.
func (p *partState) spill() bool {
	s := p.st.s
	if s.cfg.Ordering != OrderKey || !p.starved() {
		return false
	}
	target := s.cfg.PartitionWindow - max(s.cfg.PartitionWindow/4, 1)
	limit := spillFactor * s.cfg.PartitionWindow
	now := time.Now()
	freed := false
	for p.undone > target && p.spilled < limit {
		var key string
		var most *chain
		for k, c := range p.chains {
			if c.held > 0 && (most == nil || c.held > most.held) && p.blocked(c.head, now) {
				key, most = k, c
			}
		}
		if most == nil {
			break
		}
		for i := len(p.window) - 1; i >= 0 && most.held > 0 && p.undone > target && p.spilled < limit; i-- {
			e := p.window[i]
			if e.state != stateWaiting || e.key != key {
				continue
			}
			e.state = stateSpilled
			e.m = nil
			most.held--
			p.undone--
			p.spilled++
			s.stats.spilled++
			freed = true
		}
	}
	return freed
}

// A head that has not failed counts as slow, and its key as blocked, once
// its handler has run for slowFactor × the partition's typical handler
// time, and at least minSlow (which is all there is before the partition's
// first ack). A head still queued for a MaxInFlight slot is not slow: its
// key is not what holds it up.
const (
	slowFactor = 8
	minSlow    = 50 * time.Millisecond
)

// slowAfter is how long a head may take before it counts as slow. Called
// with mu held.
func (p *partState) slowAfter() time.Duration { return max(slowFactor*p.typical, minSlow) }

// blocked reports whether head, a key's first record not done, holds its
// key up: it failed (nacked, backing off, or cannot be unmarshalled), it
// waits for its NotBeforeFunc time, or its handler is slow
// (partState.slowAfter). Called with mu held.
func (p *partState) blocked(head *entry, now time.Time) bool {
	switch {
	case head.state == stateBackoff || head.state == stateHeld || head.state == stateFailed || head.nacks > 0:
		return true
	case head.state != stateInFlight:
		return false // spilled, or queued for a MaxInFlight slot
	}
	return now.Sub(head.start) > p.slowAfter()
}

// untilBlocked is how long until the first slow head in flight of a key
// with waiting records counts as blocked, -1 for none to come or while the
// partition is not starved (spill would not spill: partState.kick wakes
// the partition when it is). Called with mu held.
func (p *partState) untilBlocked(now time.Time) time.Duration {
	if p.st.s.cfg.Ordering != OrderKey || p.spilled >= spillFactor*p.st.s.cfg.PartitionWindow || !p.starved() {
		return -1
	}
	wait := time.Duration(-1)
	for _, c := range p.chains {
		if c.held == 0 || c.head.state != stateInFlight {
			continue
		}
		d := max(c.head.start.Add(p.slowAfter()).Sub(now), 0) + time.Millisecond
		if wait < 0 || d < wait {
			wait = d
		}
	}
	return wait
}

// observe folds d, the time a head's handler took (hand-out to ack), into
// the partition's typical handler time: a moving average in which no sample
// counts for more than 4 × the average, so that one slow key does not make
// itself typical. Called with mu held.
func (p *partState) observe(d time.Duration) {
	if p.typical <= 0 {
		p.typical = max(d, time.Microsecond)
		return
	}
	d = min(d, 4*p.typical)
	p.typical += (d - p.typical) / 16
	p.typical = max(p.typical, time.Microsecond)
}

// starved reports whether spilling p's blocked keys could give a handler
// work: p has no ready record of its own, and p has fewer messages in
// flight than its share of MaxInFlight (the next freed slots go to it:
// stream.pickReady), or a MaxInFlight slot is free with no ready record
// of the stream queued for it. Otherwise the handlers hold p
// up, not its blocked keys: with a backlog a window holds far more ready
// heads than MaxInFlight, and spilling would only read records twice.
// Called with mu held.
func (p *partState) starved() bool {
	if p.hasReady() {
		return false
	}
	s := p.st.s
	share := max(s.cfg.MaxInFlight/max(len(p.st.parts), 1), 1)
	return p.inflight < share || s.stats.inflight < s.cfg.MaxInFlight && !p.st.hasReady()
}

// hasReady reports whether p has a ready record. Called with mu held.
func (p *partState) hasReady() bool {
	for _, e := range p.ready {
		if e.state == stateReady {
			return true
		}
	}
	return false
}

// kick wakes p's claim loop when its window is full and it is starved, so
// that it spills (partState.spill). Called with mu held.
func (p *partState) kick() {
	if p.st.s.cfg.Ordering == OrderKey && !p.stopping && p.full() && p.starved() {
		select {
		case p.space <- struct{}{}:
		default:
		}
	}
}

// kickAll kicks the stream's partitions: a MaxInFlight slot is free and
// nothing of the stream is ready for it. Called with mu held.
func (st *stream) kickAll() {
	for _, p := range st.parts {
		p.kick()
	}
}

// refetch queues e, a spilled record that became its key's head, to be
// read again from Kafka. Called with mu held.
func (p *partState) refetch(e *entry) {
	p.fetch = append(p.fetch, e)
	if p.fetching {
		return
	}
	p.fetching = true
	st := p.st
	st.fetchers.Add(1)
	go func() {
		defer st.fetchers.Done()
		p.fetchLoop()
	}()
}

// fetchLoop reads the queued spilled heads again from Kafka, in passes
// from the lowest of them, until the queue is empty or the partition is
// revoked.
func (p *partState) fetchLoop() {
	s := p.st.s
	for {
		s.mu.Lock()
		heads := p.fetch[:0]
		for _, e := range p.fetch {
			if e.state == stateSpilled {
				heads = append(heads, e)
			}
		}
		clear(p.fetch[len(heads):])
		p.fetch = heads
		if len(heads) == 0 || p.stopping {
			p.fetching = false
			clear(p.fetch)
			p.fetch = nil
			s.mu.Unlock()
			return
		}
		pass := &refillPass{heads: slices.Clone(heads), from: heads[0].off}
		for _, e := range heads {
			pass.from = min(pass.from, e.off)
		}
		s.mu.Unlock()
		p.st.refill(p, pass)
	}
}

// refillPass is one read of a partition from the lowest spilled head
// queued when it started.
type refillPass struct {
	heads []*entry // queued when the pass started
	from  int64
	ended bool // it read up to the last record read from the claim
}

// refilled puts m, read again from Kafka, back into its spilled entry: a
// queued head always (it is released), another spilled record while the
// window has room (it waits as before). It reports whether the pass is
// over: it reached the last record read from the claim, or no queued head
// is left and the window is full. At the end of a pass that read every
// record, a head of the pass not found is gone (retention, compaction):
// nothing to process. Called with mu held.
func (p *partState) refilled(pass *refillPass, m *sarama.ConsumerMessage) (over bool) {
	s := p.st.s
	if p.stopping {
		return true
	}
	if m.Offset >= p.next {
		pass.ended = true
	} else if i, ok := slices.BinarySearchFunc(p.window, m.Offset, func(e *entry, off int64) int { return cmp.Compare(e.off, off) }); ok {
		e := p.window[i]
		isHead := e.state == stateSpilled && p.chains[e.key] != nil && p.chains[e.key].head == e
		if e.state == stateSpilled && (isHead || p.undone < s.cfg.PartitionWindow) {
			e.m = m
			p.spilled--
			s.stats.spilled--
			s.stats.refetched++
			p.undone++
			if isHead {
				p.waiting--
				s.stats.waiting--
				p.release(e)
			} else {
				e.state = stateWaiting
				p.chains[e.key].held++
			}
		}
	}
	if m.Offset+1 >= p.next {
		pass.ended = true
	}
	if pass.ended {
		for _, e := range pass.heads {
			if e.state == stateSpilled {
				p.spilled--
				s.stats.spilled--
				p.waiting--
				s.stats.waiting--
				p.done(e)
			}
		}
		return true
	}
	if p.undone < s.cfg.PartitionWindow {
		return false
	}
	for _, e := range p.fetch {
		if e.state == stateSpilled && e.off > m.Offset {
			return false
		}
	}
	return true
}
