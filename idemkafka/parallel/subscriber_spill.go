package parallel

import (
	"slices"
	"time"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// spill drops the payloads of waiting records of blocked keys until a
// quarter of the window is free (keywindow.Window.Spill: the blocked key
// with the most waiting records first, the latest first, as far as the
// spill bound allows). They are read again from Kafka when they become
// their key's head. A key whose head moves is not spilled: its records
// would be read twice for nothing, and the window's back-pressure is
// right for it. Nothing is spilled but with OrderKey, nor when reading on
// would give no handler work (partState.starved). It reports whether it
// freed room. Called with mu held.
func (p *partState) spill() bool {
	s := p.st.s
	if s.cfg.Ordering != OrderKey || !p.starved() {
		return false
	}
	now := time.Now()
	return p.win.Spill(func(head *entry) bool { return p.blocked(head, now) }, func(e *entry) { e.m = nil })
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
	case head.State == keywindow.Backoff || head.State == keywindow.Held || head.State == keywindow.Failed || head.nacks > 0:
		return true
	case head.State != keywindow.InFlight:
		return false // spilled, or queued for a MaxInFlight slot
	}
	return now.Sub(head.start) > p.slowAfter()
}

// untilBlocked is how long until the first slow head in flight of a key
// with waiting records counts as blocked, -1 for none to come or while the
// partition is not starved (spill would not spill: partState.kick wakes
// the partition when it is). Called with mu held.
func (p *partState) untilBlocked(now time.Time) time.Duration {
	if p.st.s.cfg.Ordering != OrderKey || !p.win.SpillRoom() || !p.starved() {
		return -1
	}
	wait := time.Duration(-1)
	for head := range p.win.Blocking() {
		if head.State != keywindow.InFlight {
			continue
		}
		d := max(head.start.Add(p.slowAfter()).Sub(now), 0) + time.Millisecond
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
// work (keywindow.Starved): p has no ready record of its own, and fewer
// messages in flight than its share of MaxInFlight (the next freed slots
// go to it: stream.pickReady), or a MaxInFlight slot is free with no
// ready record of the stream queued for it. Called with mu held.
func (p *partState) starved() bool {
	s := p.st.s
	return keywindow.Starved(keywindow.Load{
		Ready: p.hasReady(), InFlight: p.inflight, Partitions: len(p.st.parts),
		Total: s.stats.inflight, MaxInFlight: s.cfg.MaxInFlight,
	}, p.st.hasReady)
}

// hasReady reports whether p has a ready record. Called with mu held.
func (p *partState) hasReady() bool {
	for _, e := range p.ready {
		if e.State == keywindow.Ready {
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
			if e.State == keywindow.Spilled {
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
		pass := &refillPass{heads: slices.Clone(heads), from: heads[0].Off}
		for _, e := range heads {
			pass.from = min(pass.from, e.Off)
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
	if m.Offset >= p.win.Next() {
		pass.ended = true
	} else if e, ok := p.win.Find(m.Offset); ok {
		if head, ok := p.win.Refill(e); ok {
			e.m = m
			s.stats.refetched++
			if head {
				p.release(e)
			}
		}
	}
	if m.Offset+1 >= p.win.Next() {
		pass.ended = true
	}
	if pass.ended {
		p.lost(pass.heads, -1)
		return true
	}
	if !p.full() {
		return false
	}
	for _, e := range p.fetch {
		if e.State == keywindow.Spilled && e.Off > m.Offset {
			return false
		}
	}
	return true
}

// lost marks done the spilled heads of heads not read again (at offset
// off, or any for off < 0): retention or compaction removed them, nothing
// to process. Called with mu held.
func (p *partState) lost(heads []*entry, off int64) {
	for _, e := range heads {
		if e.State == keywindow.Spilled && (off < 0 || e.Off == off) {
			p.done(e)
		}
	}
}
