package franz

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// entry is one record of a partition's window (internal/keywindow holds
// its offset, key, state and key chain).
type entry struct {
	keywindow.Entry[*entry]
	r      *kgo.Record // nil once done
	p      *part
	timer  *time.Timer
	cancel context.CancelFunc // ends the context of the attempt handed out last
}

// WindowEntry implements keywindow.Elem.
func (e *entry) WindowEntry() *keywindow.Entry[*entry] { return &e.Entry }

// windowOrdering is o as internal/keywindow's.
func windowOrdering(o parallel.Ordering) keywindow.Ordering {
	switch o {
	case parallel.OrderPartition:
		return keywindow.ByPartition
	case parallel.OrderNone:
		return keywindow.Unordered
	}
	return keywindow.ByKey
}

// part is an assigned partition: the window of records from the lowest
// one not done on (internal/keywindow: key order, the commit offset, the
// bound), and the fetching and commits around it. Every field is guarded
// by its stream's mu.
type part struct {
	st  *stream
	id  int32
	ctx context.Context // the messages' parent; cancelled when abandoned
	end context.CancelFunc

	win       *keywindow.Window[*entry]
	ready     []*entry
	epoch     int32 // the leader epoch of the last record read
	inflight  int
	stopping  bool // revoked: nothing more is handed out
	paused    bool // its fetching is paused (window full)
	committed int64
	drained   chan struct{} // stopping and nothing in flight (buffered 1)
	// timeline is PostgreSQL's timeline when the partition's position was
	// read (Progress): a write on another one is fenced. saved is the
	// position last written there or read from there, -1 for none.
	timeline int64
	saved    int64
}

func newPart(st *stream, id int32) *part {
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	cfg := keywindow.Config{Ordering: windowOrdering(st.s.cfg.Ordering), Size: st.s.cfg.PartitionWindow}
	return &part{st: st, id: id, ctx: ctx, end: cancel, win: keywindow.New[*entry](cfg, -1, nil),
		epoch: -1, committed: -1, saved: -1, drained: make(chan struct{}, 1)}
}

// full reports whether the window holds PartitionWindow records not done.
func (p *part) full() bool { return p.win.Full() }

// add appends a record read from the partition and queues it when nothing
// of its key is before it. Records below the last read (a refetch) are
// ignored.
func (p *part) add(r *kgo.Record) {
	if p.stopping || !p.win.Read(r.Offset) {
		return
	}
	p.epoch = r.LeaderEpoch
	e := &entry{r: r, p: p}
	if p.win.Add(e, r.Offset, r.Key) {
		p.st.push(e)
	}
}

// acked records e done: the next record of its key is released and the
// window's done front leaves it.
func (p *part) acked(e *entry) {
	if e.State != keywindow.InFlight {
		return
	}
	p.settled()
	if p.stopping && p.ctx.Err() != nil {
		e.State = keywindow.Dropped // abandoned: too late for the final commit
		return
	}
	e.r = nil
	if next := p.win.Done(e); next != nil && next.State == keywindow.Waiting && !p.stopping {
		p.st.push(next)
	}
	if p.paused && p.roomForAPoll() && !p.stopping {
		p.paused = false
		p.st.cl.ResumeFetchPartitions(map[string][]int32{p.st.topic: {p.id}})
	}
}

// roomForAPoll reports whether a paused partition may fetch again: its
// window has room for a poll (PollRecords, at most half the window).
// Resuming at the first free slot would fetch a batch of which one poll
// fits before the window is full again, and franz-go drops the rest of a
// paused partition's buffered records, to fetch them again.
func (p *part) roomForAPoll() bool {
	size := p.st.s.cfg.PartitionWindow
	room := max(1, min(p.st.s.cfg.PollRecords, size/2)) // a window of 1 resumes empty, not full
	return p.win.Undone() <= size-room
}

// nacked hands e out again after NackResendSleep; the later records of its
// key stay behind it.
func (p *part) nacked(e *entry) {
	if e.State != keywindow.InFlight {
		return
	}
	p.settled()
	if p.stopping {
		e.State = keywindow.Dropped // the next owner gets it again
		return
	}
	sleep := p.st.s.cfg.NackResendSleep
	if sleep <= 0 {
		p.st.push(e)
		return
	}
	e.State = keywindow.Backoff
	e.timer = time.AfterFunc(sleep, func() {
		p.st.mu.Lock()
		defer p.st.mu.Unlock()
		e.timer = nil
		if e.State == keywindow.Backoff && !p.stopping {
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

// commitOffset is the offset below which every record read is done, -1
// before the first record.
func (p *part) commitOffset() int64 { return p.win.CommitOffset() }

// stop marks p revoked: nothing more is handed out, its timers stop.
func (p *part) stop() {
	p.stopping = true
	clear(p.ready)
	p.ready = nil
	p.win.Stop(func(e *entry) {
		if e.timer != nil {
			e.timer.Stop()
			e.timer = nil
		}
	})
	if p.inflight == 0 {
		select {
		case p.drained <- struct{}{}:
		default:
		}
	}
}
