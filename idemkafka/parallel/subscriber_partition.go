package parallel

import (
	"context"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
)

type entryState uint8

const (
	stateWaiting  entryState = iota // behind an earlier message of its key
	stateHeld                       // waiting for its NotBeforeFunc time
	stateReady                      // queued to be handed out
	stateInFlight                   // handed out, no ack or nack yet
	stateBackoff                    // nacked, waiting NackResendSleep
	stateDone                       // acked (or done before, per the commit metadata)
	stateFailed                     // cannot be unmarshalled: its key and the committed offset stop at it
	stateDropped                    // its partition was revoked before it was handed out
	stateSpilled                    // behind an earlier message of its key, payload dropped: read again from Kafka when it is its key's head
)

// spillFactor × PartitionWindow bounds the spilled records of a partition.
const spillFactor = 64

// entry is one record of a partition's window.
type entry struct {
	m     *sarama.ConsumerMessage // nil once done: the payload goes
	off   int64
	p     *partState
	key   string
	state entryState
	next  *entry      // the next record of its key (OrderKey, OrderPartition)
	timer *time.Timer // while held or backing off; stopped on revoke
	// cancel ends the context of the attempt handed out last.
	cancel context.CancelFunc

	// For stall detection.
	head    time.Time // when it became its key's head (released)
	start   time.Time // when its current attempt was handed out
	nacks   int
	lastErr error    // of the last nack, when RecordErrors saw it
	slot    *errSlot // the current attempt's, for RecordErrors
	stalled bool     // its stall was logged
}

// chain is the records of one key in a partition's window that are not done
// yet, oldest first; only its head may be handed out.
type chain struct {
	head, tail *entry
	held       int // its waiting records with their payload (not spilled)
}

// partState is a claimed partition: the window of records from the
// committed offset on. Every field is guarded by the Subscriber's mu.
type partState struct {
	st        *stream
	sess      sarama.ConsumerGroupSession
	partition int32

	ctx    context.Context // messages' parent; cancelled when abandoned
	cancel context.CancelFunc

	// window is the records read and not done, in offset order, from the
	// committed offset on: the first is the committed record. Done records
	// leave it (those at its front at once, the others in batches): the
	// offsets between two undone records are done, so the window's size is
	// bounded by what is not done, not by the span of offsets.
	window []*entry
	undone int // records of window not done and not spilled: at most PartitionWindow
	// spilled counts the window's spilled records (at most spillFactor ×
	// PartitionWindow); fetch queues those that became their key's head,
	// to be read again from Kafka by one fetcher at a time (fetching).
	spilled  int
	fetch    []*entry
	fetching bool
	chains   map[string]*chain
	skip     []run // done before, per the commit metadata, ascending
	ready    []*entry

	progress time.Time     // the last ack, or when the window last became non-empty
	typical  time.Duration // a head's typical time from release to ack (partState.observe)

	next     int64 // the offset after the last record read
	highest  int64 // the highest offset handed out, -1 for none
	inflight int
	waiting  int
	stopping bool          // revoked: nothing more is handed out
	gone     bool          // revoked and marked: the window is released
	space    chan struct{} // the window shrank (buffered 1)
	drained  chan struct{} // stopping and nothing in flight (buffered 1)

	marked  int64 // last offset given to the session
	meta    string
	changed bool // done set changed since the last mark

	savedNext int64 // marked and meta as last written to PostgreSQL (Progress)
	savedDone string
}

func (s *Subscriber) newPartState(st *stream, sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim, skip []run) *partState {
	// Messages keep their values when the stream ends, and are cancelled
	// only when abandoned after RevokeTimeout.
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	return &partState{
		st: st, sess: sess, partition: claim.Partition(),
		ctx: ctx, cancel: cancel,
		chains:    map[string]*chain{},
		skip:      skip,
		next:      claim.InitialOffset(),
		highest:   -1,
		marked:    -1,
		savedNext: -1,
		space:     make(chan struct{}, 1),
		drained:   make(chan struct{}, 1),
	}
}

// full reports whether the window holds PartitionWindow records.
func (p *partState) full() bool { return p.undone >= p.st.s.cfg.PartitionWindow }

// skipped reports whether offset is done per the commit metadata, dropping
// the runs below it (records come in offset order).
func (p *partState) skipped(offset int64) bool {
	for len(p.skip) > 0 && p.skip[0].end <= offset {
		p.skip = p.skip[1:]
	}
	return len(p.skip) > 0 && p.skip[0].start <= offset
}

// add appends a record read from the claim and queues it when nothing of
// its key is before it. Called with mu held.
func (p *partState) add(m *sarama.ConsumerMessage) {
	s := p.st.s
	p.next = m.Offset + 1
	if p.skipped(m.Offset) {
		// Done before: it never enters the window. At the window's start
		// (the committed record itself was removed by retention,
		// DeleteRecords or compaction) the committed offset moves past it
		// now, since no ack will.
		s.stats.skipped++
		p.changed = true
		return
	}
	e := &entry{m: m, off: m.Offset, p: p}
	if p.undone == 0 {
		p.progress = time.Now()
	}
	p.window = append(p.window, e)
	p.undone++
	switch s.cfg.Ordering {
	case OrderNone:
		p.release(e)
		return
	case OrderKey:
		e.key = string(m.Key)
	}
	c := p.chains[e.key]
	if c == nil {
		p.chains[e.key] = &chain{head: e, tail: e}
		p.release(e)
		return
	}
	c.tail.next = e
	c.tail = e
	c.held++
	e.state = stateWaiting
	p.waiting++
	s.stats.waiting++
}

// release queues e, or holds it until its NotBeforeFunc time. Called with
// mu held.
func (p *partState) release(e *entry) {
	s := p.st.s
	e.head = time.Now()
	if f := s.cfg.NotBeforeFunc; f != nil {
		if d := time.Until(f(e.m)); d > 0 {
			e.state = stateHeld
			s.stats.held++
			e.timer = time.AfterFunc(d, func() {
				s.mu.Lock()
				defer s.mu.Unlock()
				e.timer = nil
				if e.state == stateHeld {
					s.stats.held--
					e.head = time.Now() // its wait for a stall starts now
					if !p.stopping {
						p.st.push(e)
					}
				}
			})
			return
		}
	}
	p.st.push(e)
}

// acked records e done: the next record of its key is released, the
// committed offset moves past the records done at the front of the window.
// Called with mu held.
func (p *partState) acked(e *entry) {
	s := p.st.s
	if e.state != stateInFlight {
		return
	}
	p.settled(e)
	s.stats.acked++
	if !e.head.IsZero() {
		p.observe(time.Since(e.head))
	}
	if p.gone {
		e.state = stateDropped // too late for the final commit
		return
	}
	p.undone--
	p.done(e)
}

// done records e, its key's head, done: the next record of its key is
// released (or read again, when spilled), and the committed offset moves
// past the records done at the front of the window. Called with mu held.
func (p *partState) done(e *entry) {
	s := p.st.s
	e.state = stateDone
	e.m, e.slot, e.lastErr = nil, nil, nil
	p.progress = time.Now()
	p.changed = true
	if e.stalled {
		p.st.logger.Info("Stalled key acked", watermill.LogFields{
			"kafka_partition": p.partition, "key": e.key, "kafka_partition_offset": e.off,
			"stalled_for": time.Since(e.head).Round(time.Millisecond).String(), "nacks": e.nacks,
		})
	}
	if s.cfg.Ordering != OrderNone {
		c := p.chains[e.key]
		c.head = e.next
		e.next = nil
		switch {
		case c.head == nil:
			delete(p.chains, e.key)
		case c.head.state == stateWaiting:
			c.held--
			p.waiting--
			s.stats.waiting--
			p.release(c.head)
		case c.head.state == stateSpilled:
			p.refetch(c.head)
		}
	}
	p.trim()
}

// nacked hands e out again after NackResendSleep; the later records of
// its key stay behind it. Called with mu held.
func (p *partState) nacked(e *entry) {
	s := p.st.s
	if e.state != stateInFlight {
		return
	}
	p.settled(e)
	s.stats.nacked++
	e.nacks++
	if err := e.slot.get(); err != nil {
		e.lastErr = err
	}
	if p.stopping || p.gone {
		e.state = stateDropped // the next owner gets it again
		return
	}
	sleep := s.cfg.NackResendSleep
	if sleep <= 0 {
		p.st.push(e)
		return
	}
	e.state = stateBackoff
	e.timer = time.AfterFunc(sleep, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		e.timer = nil
		if e.state == stateBackoff && !p.stopping {
			p.st.push(e)
		}
	})
}

// settled counts e, in flight, out of flight. Called with mu held.
func (p *partState) settled(e *entry) {
	p.inflight--
	p.st.s.stats.inflight--
	if p.stopping && p.inflight == 0 {
		select {
		case p.drained <- struct{}{}:
		default:
		}
	}
}

// drop gives up e, in flight but never taken by the router. Called with
// mu held.
func (p *partState) drop(e *entry) {
	if e.state == stateInFlight {
		p.settled(e)
		e.state = stateDropped
	}
}

// trim drops the done records at the front of the window, and the others
// once they are more than the rest, and signals the room. Called with mu
// held.
func (p *partState) trim() {
	n := 0
	for n < len(p.window) && p.window[n].state == stateDone {
		n++
	}
	if n > 0 {
		clear(p.window[:n])
		p.window = p.window[n:]
	}
	if done := len(p.window) - p.undone - p.spilled; done > p.undone+p.spilled && done > 32 {
		kept := p.window[:0]
		for _, e := range p.window {
			if e.state != stateDone {
				kept = append(kept, e)
			}
		}
		clear(p.window[len(kept):])
		p.window = kept
	}
	if len(p.window) == 0 {
		p.window = nil
	}
	select {
	case p.space <- struct{}{}:
	default:
	}
}

// commitOffset is the offset below which every record is done.
func (p *partState) commitOffset() int64 {
	if len(p.window) > 0 {
		return p.window[0].off
	}
	return p.next
}

// doneRuns are the done offsets above the committed one: those between the
// records of the window that are not done, after the last of them up to
// the last record read, and the runs of the commit metadata not read yet.
// Called with mu held.
func (p *partState) doneRuns() []run {
	var done []run
	add := func(r run) {
		if r.end <= r.start {
			return
		}
		if n := len(done); n > 0 && done[n-1].end >= r.start {
			done[n-1].end = max(done[n-1].end, r.end)
			return
		}
		done = append(done, r)
	}
	prev := p.commitOffset()
	for _, e := range p.window {
		if e.state == stateDone {
			continue
		}
		add(run{prev, e.off})
		prev = e.off + 1
	}
	add(run{prev, p.next})
	for _, r := range p.skip {
		add(run{max(r.start, p.next), r.end})
	}
	return done
}

// mark gives the session the committed offset and, in its metadata, the
// done offsets above it. Called with mu held.
func (p *partState) mark() {
	off := p.commitOffset()
	if off < 0 || off == p.marked && !p.changed {
		return
	}
	meta := ""
	if limit := p.st.metaMax; limit > 0 {
		meta = encodeDone(off, p.doneRuns(), limit)
	}
	if off == p.marked && meta == p.meta {
		p.changed = false
		return
	}
	// MarkOffset moves the offset forward only; ResetOffset with the same
	// offset replaces the metadata.
	p.sess.MarkOffset(p.st.topic, p.partition, off, meta)
	p.sess.ResetOffset(p.st.topic, p.partition, off, meta)
	p.marked, p.meta, p.changed = off, meta, false
}
