package parallel

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
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

	progress time.Time // the last ack, or when the window last became non-empty

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
}

func (s *Subscriber) newPartState(st *stream, sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim, skip []run) *partState {
	// Messages keep their values when the stream ends, and are cancelled
	// only when abandoned after RevokeTimeout.
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	return &partState{
		st: st, sess: sess, partition: claim.Partition(),
		ctx: ctx, cancel: cancel,
		chains:  map[string]*chain{},
		skip:    skip,
		next:    claim.InitialOffset(),
		highest: -1,
		marked:  -1,
		space:   make(chan struct{}, 1),
		drained: make(chan struct{}, 1),
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

// spill drops the payloads of waiting records until a quarter of the
// window is free, as far as the spill bound allows: those of the key with
// the most waiting records first (a failing or slow key's backlog), the
// latest first. They stay in the window (the committed offset and the
// commit metadata count them as not done) and in their key's chain, but
// not in PartitionWindow, and are read again from Kafka when they become
// their key's head. It reports whether it freed room. Called with mu held.
func (p *partState) spill() bool {
	s := p.st.s
	target := s.cfg.PartitionWindow - max(s.cfg.PartitionWindow/4, 1)
	limit := spillFactor * s.cfg.PartitionWindow
	freed := false
	for p.undone > target && p.spilled < limit {
		var key string
		var most *chain
		for k, c := range p.chains {
			if c.held > 0 && (most == nil || c.held > most.held) {
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
	if max := p.st.metaMax; max > 0 {
		meta = encodeDone(off, p.doneRuns(), max)
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

// stalls are p's keys whose head has waited StallTimeout or longer
// without an ack. Called with mu held.
func (p *partState) stalls(now time.Time) []Stall {
	timeout := p.st.s.cfg.StallTimeout
	if timeout < 0 || p.stopping {
		return nil
	}
	var out []Stall
	for _, e := range p.window {
		switch e.state {
		case stateReady, stateInFlight, stateBackoff, stateFailed:
		default:
			continue // done, held, or behind its key's head
		}
		if e.head.IsZero() || now.Sub(e.head) < timeout {
			continue
		}
		st := Stall{Topic: p.st.topic, Partition: p.partition, Key: e.key, Offset: e.off, For: now.Sub(e.head), Nacks: e.nacks, LastError: e.lastErr}
		if e.state == stateInFlight {
			st.Running = now.Sub(e.start)
		}
		switch {
		case st.Running >= timeout:
			st.Cause = StallSlow
		case e.nacks > 0 || e.state == stateFailed:
			st.Cause = StallFailing
		default:
			st.Cause = StallQueued
		}
		out = append(out, st)
	}
	return out
}

// logStalls logs each key that stalled since the last call, once. Called
// without mu.
func (p *partState) logStalls() {
	s := p.st.s
	if s.cfg.StallTimeout < 0 {
		return
	}
	now := time.Now()
	s.mu.Lock()
	var fresh []Stall
	for _, st := range p.stalls(now) {
		i, ok := slices.BinarySearchFunc(p.window, st.Offset, func(e *entry, off int64) int { return cmp.Compare(e.off, off) })
		if !ok || p.window[i].stalled {
			continue
		}
		p.window[i].stalled = true
		fresh = append(fresh, st)
	}
	s.mu.Unlock()
	for _, st := range fresh {
		fields := watermill.LogFields{
			"kafka_partition": st.Partition, "key": st.Key, "kafka_partition_offset": st.Offset, "cause": string(st.Cause),
			"stalled_for": st.For.Round(time.Millisecond).String(), "nacks": st.Nacks,
		}
		var err error
		switch st.Cause {
		case StallSlow:
			fields["running"] = st.Running.Round(time.Millisecond).String()
			err = fmt.Errorf("its handler running %.0f s", st.Running.Seconds())
		case StallFailing:
			err = st.LastError
			if err == nil {
				err = errors.New("nacked; add parallel.RecordErrors to the router to see the error")
			}
		default:
			err = errors.New("waiting for a MaxInFlight slot")
		}
		p.st.logger.Error("Key stalled ("+string(st.Cause)+"): its later records wait, the other keys of its partition flow", err, fields)
	}
}

// groupHandler is the sarama.ConsumerGroupHandler of a stream.
type groupHandler struct {
	st   *stream
	skip map[int32][]run // per partition, from the commit metadata
}

// Setup reads the commit metadata of the claimed partitions: the offsets
// above the committed one that are done already.
func (h *groupHandler) Setup(sess sarama.ConsumerGroupSession) error {
	h.st.s.mu.Lock()
	h.st.s.stats.sessions++
	h.st.s.mu.Unlock()
	h.skip = map[int32][]run{}
	parts := sess.Claims()[h.st.topic]
	if len(parts) == 0 || h.st.s.cfg.CommitMetadataMaxBytes < 0 {
		return nil
	}
	done, err := h.st.fetchDone(parts)
	if err != nil {
		// Only an optimization: the records run again, their claims absorb it.
		h.st.logger.Info("Could not read the commit metadata, done records above the committed offsets run again", watermill.LogFields{"err": err.Error()})
		return nil
	}
	h.skip = done
	return nil
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (h *groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim reads the partition into its window while the window has
// room, marks the committed offset on a timer, and on revocation gives the
// messages in flight RevokeTimeout before the final mark.
func (h *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	st := h.st
	s := st.s
	skip := h.skip[claim.Partition()]
	p := s.newPartState(st, sess, claim, skip)
	s.mu.Lock()
	st.parts[p.partition] = p
	s.mu.Unlock()
	defer p.revoke()

	interval := s.sarama.Consumer.Offsets.AutoCommit.Interval / 2
	if interval <= 0 {
		interval = 500 * time.Millisecond
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	msgs := claim.Messages()
	done := sess.Context().Done()
	for {
		s.mu.Lock()
		full := p.full() && !p.spill()
		s.mu.Unlock()
		if full {
			select {
			case <-p.space:
				continue
			case <-tick.C:
				s.mu.Lock()
				p.mark()
				s.mu.Unlock()
				p.logStalls()
				continue
			case <-done:
				return nil
			}
		}
		select {
		case m, ok := <-msgs:
			if !ok {
				return nil
			}
			s.mu.Lock()
			p.add(m)
			s.mu.Unlock()
		case <-tick.C:
			s.mu.Lock()
			p.mark()
			s.mu.Unlock()
			p.logStalls()
		case <-done:
			return nil
		}
	}
}

// revoke stops handing out the partition's records, waits up to
// RevokeTimeout for the ones in flight, marks the committed offset and
// abandons the rest (their contexts are cancelled).
func (p *partState) revoke() {
	s := p.st.s
	s.mu.Lock()
	p.stopping = true
	inflight := p.inflight
	for _, e := range p.window {
		switch e.state {
		case stateHeld:
			s.stats.held--
		case stateWaiting:
			s.stats.waiting--
		case stateSpilled:
			s.stats.waiting--
			s.stats.spilled--
		case stateReady, stateBackoff:
		default:
			continue
		}
		e.state = stateDropped
		if e.timer != nil {
			// A held or backing-off record's timer would keep the
			// window, payloads included, until it fires (hours, with long
			// back-offs).
			e.timer.Stop()
			e.timer = nil
		}
	}
	p.waiting = 0
	p.st.unready(p)
	s.mu.Unlock()
	if inflight > 0 {
		t := time.NewTimer(s.cfg.Client.RevokeTimeout)
		select {
		case <-p.drained:
		case <-t.C:
		}
		t.Stop()
	}
	s.mu.Lock()
	p.mark()
	if p.inflight > 0 {
		p.st.logger.Info("Partition revoked with messages in flight: abandoned, the next owner gets them again", watermill.LogFields{
			"partition": p.partition, "in_flight": p.inflight, "committed": p.marked,
		})
	}
	if p.st.parts[p.partition] == p {
		delete(p.st.parts, p.partition)
	}
	// Only the messages still in flight stay referenced (by their
	// awaiting goroutines, up to MaxInFlight): the rest of the window goes.
	p.gone = true
	clear(p.window)
	p.window, p.chains, p.skip = nil, nil, nil
	s.mu.Unlock()
	p.cancel()
}

// fetchDone reads the committed offsets and metadata of parts from the
// group coordinator.
func (st *stream) fetchDone(parts []int32) (map[int32][]run, error) {
	cfg := st.s
	b, err := st.client.Coordinator(cfg.cfg.ConsumerGroup)
	if err != nil {
		return nil, err
	}
	req := sarama.NewOffsetFetchRequest(cfg.sarama.Version, cfg.cfg.ConsumerGroup, map[string][]int32{st.topic: parts})
	resp, err := b.FetchOffset(req)
	if err != nil {
		return nil, err
	}
	out := map[int32][]run{}
	for _, part := range parts {
		blk := resp.GetBlock(st.topic, part)
		if blk == nil || blk.Err != sarama.ErrNoError || blk.Offset < 0 {
			continue
		}
		if done := decodeDone(blk.Offset, blk.Metadata, cfg.cfg.PartitionWindow); len(done) > 0 {
			out[part] = done
		}
	}
	return out, nil
}
