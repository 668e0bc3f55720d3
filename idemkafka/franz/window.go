package franz

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

type entryState uint8

const (
	stateWaiting  entryState = iota // behind an earlier record of its key
	stateReady                      // queued to be handed out
	stateInFlight                   // handed out, no ack or nack yet
	stateBackoff                    // nacked, waiting NackResendSleep
	stateDone                       // acked
	stateDropped                    // its partition was revoked
)

// entry is one record of a partition's window.
type entry struct {
	r      *kgo.Record // nil once done
	off    int64
	p      *part
	key    string
	state  entryState
	next   *entry // the next record of its key
	timer  *time.Timer
	cancel context.CancelFunc // ends the context of the attempt handed out last
}

// chain is the records of one key not done yet, oldest first: only its
// head may be handed out.
type chain struct{ head, tail *entry }

// part is an assigned partition: the window of records from the lowest
// one not done on. Every field is guarded by its stream's mu.
type part struct {
	st  *stream
	id  int32
	ctx context.Context // the messages' parent; cancelled when abandoned
	end context.CancelFunc

	window    []*entry // in offset order; done ones leave from the front
	undone    int
	chains    map[string]*chain
	ready     []*entry
	next      int64 // the offset after the last record read, -1 before the first
	epoch     int32 // the leader epoch of the last record read
	inflight  int
	stopping  bool // revoked: nothing more is handed out
	paused    bool // its fetching is paused (window full)
	committed int64
	drained   chan struct{} // stopping and nothing in flight (buffered 1)
}

func newPart(st *stream, id int32) *part {
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	return &part{st: st, id: id, ctx: ctx, end: cancel, chains: map[string]*chain{},
		next: -1, epoch: -1, committed: -1, drained: make(chan struct{}, 1)}
}

// full reports whether the window holds PartitionWindow records not done.
func (p *part) full() bool { return p.undone >= p.st.s.cfg.PartitionWindow }

// add appends a record read from the partition and queues it when nothing
// of its key is before it. Records below the last read (a refetch) are
// ignored.
func (p *part) add(r *kgo.Record) {
	if p.stopping || (p.next >= 0 && r.Offset < p.next) {
		return
	}
	p.next = r.Offset + 1
	p.epoch = r.LeaderEpoch
	e := &entry{r: r, off: r.Offset, p: p}
	p.window = append(p.window, e)
	p.undone++
	switch p.st.s.cfg.Ordering {
	case parallel.OrderNone:
		p.st.push(e)
		return
	case parallel.OrderKey:
		e.key = string(r.Key)
	}
	c := p.chains[e.key]
	if c == nil {
		p.chains[e.key] = &chain{head: e, tail: e}
		p.st.push(e)
		return
	}
	c.tail.next = e
	c.tail = e
	e.state = stateWaiting
}

// acked records e done: the next record of its key is released and the
// window's done front leaves it.
func (p *part) acked(e *entry) {
	if e.state != stateInFlight {
		return
	}
	p.settled()
	if p.stopping && p.ctx.Err() != nil {
		e.state = stateDropped // abandoned: too late for the final commit
		return
	}
	e.state = stateDone
	e.r = nil
	p.undone--
	if p.st.s.cfg.Ordering != parallel.OrderNone {
		c := p.chains[e.key]
		c.head = e.next
		e.next = nil
		if c.head == nil {
			delete(p.chains, e.key)
		} else if !p.stopping {
			p.st.push(c.head)
		}
	}
	p.trim()
	if p.paused && !p.full() && !p.stopping {
		p.paused = false
		p.st.cl.ResumeFetchPartitions(map[string][]int32{p.st.topic: {p.id}})
	}
}

// nacked hands e out again after NackResendSleep; the later records of its
// key stay behind it.
func (p *part) nacked(e *entry) {
	if e.state != stateInFlight {
		return
	}
	p.settled()
	if p.stopping {
		e.state = stateDropped // the next owner gets it again
		return
	}
	sleep := p.st.s.cfg.NackResendSleep
	if sleep <= 0 {
		p.st.push(e)
		return
	}
	e.state = stateBackoff
	e.timer = time.AfterFunc(sleep, func() {
		p.st.mu.Lock()
		defer p.st.mu.Unlock()
		e.timer = nil
		if e.state == stateBackoff && !p.stopping {
			p.st.push(e)
		}
	})
}

// settled counts an entry out of flight.
func (p *part) settled() {
	p.inflight--
	if p.stopping && p.inflight == 0 {
		select {
		case p.drained <- struct{}{}:
		default:
		}
	}
}

// trim drops the done records at the front of the window, and the others
// once they are more than the rest.
func (p *part) trim() {
	n := 0
	for n < len(p.window) && p.window[n].state == stateDone {
		n++
	}
	if n > 0 {
		clear(p.window[:n])
		p.window = p.window[n:]
	}
	if done := len(p.window) - p.undone; done > p.undone && done > 32 {
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
}

// commitOffset is the offset below which every record read is done, -1
// before the first record.
func (p *part) commitOffset() int64 {
	if len(p.window) > 0 {
		return p.window[0].off
	}
	return p.next
}

// stop marks p revoked: nothing more is handed out, its timers stop.
func (p *part) stop() {
	p.stopping = true
	clear(p.ready)
	p.ready = nil
	for _, e := range p.window {
		if e.timer != nil {
			e.timer.Stop()
			e.timer = nil
		}
	}
	if p.inflight == 0 {
		select {
		case p.drained <- struct{}{}:
		default:
		}
	}
}
