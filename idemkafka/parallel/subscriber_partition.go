package parallel

import (
	"context"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// entry is one record of a partition's window (internal/keywindow holds
// its offset, key, state and key chain).
type entry struct {
	keywindow.Entry[*entry]
	m     *sarama.ConsumerMessage // nil once done or spilled: the payload goes
	p     *partState
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

// WindowEntry implements keywindow.Elem.
func (e *entry) WindowEntry() *keywindow.Entry[*entry] { return &e.Entry }

// windowOrdering is o as internal/keywindow's.
func windowOrdering(o Ordering) keywindow.Ordering {
	switch o {
	case OrderPartition:
		return keywindow.ByPartition
	case OrderNone:
		return keywindow.Unordered
	}
	return keywindow.ByKey
}

// partState is a claimed partition: the window of records from the
// committed offset on (internal/keywindow: key order, the committed
// offset, the bound, the spill rule), and what the claim, the refetches
// and the commits need around it. Every field is guarded by the
// Subscriber's mu.
type partState struct {
	st        *stream
	sess      sarama.ConsumerGroupSession
	partition int32

	ctx    context.Context // messages' parent; cancelled when abandoned
	cancel context.CancelFunc

	// win is the records read and not done, in offset order, from the
	// committed offset on: at most PartitionWindow not done and not
	// spilled, at most keywindow.SpillFactor × PartitionWindow spilled.
	// fetch queues the spilled records that became their key's head, to
	// be read again from Kafka by one fetcher at a time (fetching).
	win      *keywindow.Window[*entry]
	fetch    []*entry
	fetching bool
	skip     []run // done before, per the commit metadata, ascending
	ready    []*entry

	progress time.Time     // the last ack, or when the window last became non-empty
	typical  time.Duration // a head's typical time from release to ack (partState.observe)

	highest  int64 // the highest offset handed out, -1 for none
	inflight int
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
		win: keywindow.New[*entry](keywindow.Config{Ordering: windowOrdering(s.cfg.Ordering), Size: s.cfg.PartitionWindow},
			claim.InitialOffset(), &s.stats.keys),
		skip:      skip,
		highest:   -1,
		marked:    -1,
		savedNext: -1,
		space:     make(chan struct{}, 1),
		drained:   make(chan struct{}, 1),
	}
}

// full reports whether the window holds PartitionWindow records.
func (p *partState) full() bool { return p.win.Full() }

// skipped reports whether offset is done per the commit metadata, dropping
// the runs below it (records come in offset order).
func (p *partState) skipped(offset int64) bool {
	for len(p.skip) > 0 && p.skip[0].end <= offset {
		p.skip = p.skip[1:]
	}
	return len(p.skip) > 0 && p.skip[0].start <= offset
}

// add appends a record read from the claim and queues it when nothing of
// its key is before it. A record below the last one read is ignored.
// Called with mu held.
func (p *partState) add(m *sarama.ConsumerMessage) {
	s := p.st.s
	if !p.win.Read(m.Offset) {
		return
	}
	if p.skipped(m.Offset) {
		// Done before: it never enters the window. At the window's start
		// (the committed record itself was removed by retention,
		// DeleteRecords or compaction) the committed offset moves past it
		// now, since no ack will.
		s.stats.skipped++
		p.changed = true
		return
	}
	e := &entry{m: m, p: p}
	if p.win.Undone() == 0 {
		p.progress = time.Now()
	}
	if p.win.Add(e, m.Offset, m.Key) {
		p.release(e)
	}
}

// release queues e, or holds it until its NotBeforeFunc time. Called with
// mu held.
func (p *partState) release(e *entry) {
	s := p.st.s
	e.head = time.Now()
	if f := s.cfg.NotBeforeFunc; f != nil {
		if d := time.Until(f(e.m)); d > 0 {
			e.State = keywindow.Held
			s.stats.held++
			e.timer = time.AfterFunc(d, func() {
				s.mu.Lock()
				defer s.mu.Unlock()
				e.timer = nil
				if e.State == keywindow.Held {
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
	if e.State != keywindow.InFlight {
		return
	}
	p.settled(e)
	s.stats.acked++
	if !e.start.IsZero() {
		p.observe(time.Since(e.start))
	}
	if p.gone {
		e.State = keywindow.Dropped // too late for the final commit
		return
	}
	p.done(e)
}

// done records e, its key's head, done: the next record of its key is
// released (or read again, when spilled), and the committed offset moves
// past the records done at the front of the window. Called with mu held.
func (p *partState) done(e *entry) {
	e.m, e.slot, e.lastErr = nil, nil, nil
	p.progress = time.Now()
	p.changed = true
	if e.stalled {
		p.st.logger.Info("Stalled key acked", watermill.LogFields{
			"kafka_partition": p.partition, "key": e.Key, "kafka_partition_offset": e.Off,
			"stalled_for": time.Since(e.head).Round(time.Millisecond).String(), "nacks": e.nacks,
		})
	}
	if next := p.win.Done(e); next != nil {
		switch next.State {
		case keywindow.Waiting:
			p.release(next)
		case keywindow.Spilled:
			p.refetch(next)
		}
	}
	select {
	case p.space <- struct{}{}:
	default:
	}
}

// nacked hands e out again after NackResendSleep; the later records of
// its key stay behind it. Called with mu held.
func (p *partState) nacked(e *entry) {
	s := p.st.s
	if e.State != keywindow.InFlight {
		return
	}
	p.settled(e)
	s.stats.nacked++
	e.nacks++
	if err := e.slot.get(); err != nil {
		e.lastErr = err
	}
	if p.stopping || p.gone {
		e.State = keywindow.Dropped // the next owner gets it again
		return
	}
	sleep := s.cfg.NackResendSleep
	if sleep <= 0 {
		p.st.push(e)
		return
	}
	e.State = keywindow.Backoff
	e.timer = time.AfterFunc(sleep, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		e.timer = nil
		if e.State == keywindow.Backoff && !p.stopping {
			p.st.push(e)
		}
	})
}

// settled counts e, in flight, out of flight. Called with mu held.
func (p *partState) settled(e *entry) {
	p.inflight--
	p.st.s.stats.inflight--
	if p.st.hasReady() {
		p.kick() // fewer in flight than its share, maybe
	} else {
		p.st.kickAll()
	}
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
	if e.State == keywindow.InFlight {
		p.settled(e)
		e.State = keywindow.Dropped
	}
}

// commitOffset is the offset below which every record is done.
func (p *partState) commitOffset() int64 { return p.win.CommitOffset() }

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
	for _, e := range p.win.Entries() {
		if e.State == keywindow.Done {
			continue
		}
		add(run{prev, e.Off})
		prev = e.Off + 1
	}
	next := p.win.Next()
	add(run{prev, next})
	for _, r := range p.skip {
		add(run{max(r.start, next), r.end})
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
