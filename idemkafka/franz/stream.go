package franz

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// stream is one Subscribe call: a group member on one topic, its
// partitions, and the messages ready to be handed out.
type stream struct {
	s      *Subscriber
	topic  string
	ctx    context.Context // ends on Close or when Subscribe's ctx ends
	cancel context.CancelFunc
	cl     *kgo.Client
	out    chan *message.Message
	logger watermill.LoggerAdapter

	commitMu sync.Mutex // one commit at a time: a revocation's final commit waits for a periodic one

	mu    sync.Mutex
	wake  chan struct{} // an entry became ready (buffered 1)
	parts map[int32]*part
	// fenced: a write of the positions found PostgreSQL on a new timeline,
	// the poll loop restarts the partitions; pollCancel ends its poll.
	fenced     bool
	pollCancel context.CancelFunc
}

// run polls the group until the stream ends, then gives the partitions
// RevokeTimeout, commits, leaves the group and closes out.
func (st *stream) run() {
	defer st.s.wg.Done()
	var wg sync.WaitGroup
	wg.Go(st.dispatch)
	wg.Go(st.commitLoop)
	st.poll()
	wg.Wait()
	st.mu.Lock()
	all := make([]int32, 0, len(st.parts))
	for id := range st.parts {
		all = append(all, id)
	}
	st.mu.Unlock()
	st.release(context.Background(), all, true, true)
	st.cl.Close()
	st.s.releaseInstance(st.topic)
	st.s.mu.Lock()
	delete(st.s.streams, st)
	st.s.mu.Unlock()
	close(st.out)
}

// poll adds the polled records to their partitions' windows and pauses
// the partitions whose window is full. Rebalances wait while a poll's
// records are added (BlockRebalanceOnPoll), so a revocation never races
// with them, nor with a restart of a fenced stream's partitions.
func (st *stream) poll() {
	for st.ctx.Err() == nil {
		pctx, cancel := context.WithCancel(st.ctx)
		st.mu.Lock()
		st.pollCancel = cancel
		if st.fenced {
			cancel()
		}
		st.mu.Unlock()
		fetches := st.cl.PollRecords(pctx, st.s.cfg.PollRecords)
		cancel()
		if fetches.IsClientClosed() || st.ctx.Err() != nil {
			st.cl.AllowRebalance()
			return
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if !errors.Is(err, context.Canceled) {
				st.logger.Error("Fetch failed", err, watermill.LogFields{"kafka_partition": partition})
			}
		})
		st.mu.Lock()
		var full []int32
		fetches.EachRecord(func(r *kgo.Record) {
			p := st.parts[r.Partition]
			if p == nil {
				return
			}
			p.add(r)
			if p.full() && !p.paused {
				p.paused = true
				full = append(full, p.id)
			}
		})
		if len(full) > 0 {
			st.cl.PauseFetchPartitions(map[string][]int32{st.topic: full})
		}
		fenced := st.fenced
		st.mu.Unlock()
		if fenced {
			st.restart()
		}
		st.cl.AllowRebalance()
	}
}

// push queues e as ready. Called with mu held.
func (st *stream) push(e *entry) {
	e.State = keywindow.Ready
	e.p.ready = append(e.p.ready, e)
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// dispatch hands out the ready entries, one MaxInFlight slot each, until
// the stream ends.
func (st *stream) dispatch() {
	s := st.s
	for {
		if !st.awaitReady() {
			return
		}
		select {
		case s.slots <- struct{}{}:
		case <-st.ctx.Done():
			return
		}
		st.mu.Lock()
		e := st.pickReady()
		var msg *message.Message
		if e != nil {
			msg = st.handOut(e)
		}
		st.mu.Unlock()
		if msg == nil {
			<-s.slots
			continue
		}
		select {
		case st.out <- msg:
			go st.await(e, msg)
		case <-e.p.ctx.Done():
			st.undo(e)
		case <-st.ctx.Done():
			st.undo(e)
			return
		}
	}
}

// undo gives back e, handed out but never taken by the router.
func (st *stream) undo(e *entry) {
	st.mu.Lock()
	if e.State == keywindow.InFlight {
		e.p.settled()
		e.State = keywindow.Dropped
	}
	st.mu.Unlock()
	e.cancel()
	<-st.s.slots
}

// awaitReady waits for a ready entry; false when the stream ends.
func (st *stream) awaitReady() bool {
	for {
		st.mu.Lock()
		ok := false
		for _, p := range st.parts {
			if len(p.ready) > 0 {
				ok = true
				break
			}
		}
		st.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-st.wake:
		case <-st.ctx.Done():
			return false
		}
	}
}

// pickReady takes the first ready entry of the partition with the fewest
// messages in flight, so that a partition whose handlers run long does
// not take every slot. Called with mu held.
func (st *stream) pickReady() *entry {
	var best *part
	for _, p := range st.parts {
		if len(p.ready) > 0 && !p.stopping && (best == nil || p.inflight < best.inflight) {
			best = p
		}
	}
	if best == nil {
		return nil
	}
	e := best.ready[0]
	best.ready[0] = nil
	best.ready = best.ready[1:]
	return e
}

// handOut marks e in flight and builds its message. Called with mu held.
func (st *stream) handOut(e *entry) *message.Message {
	p := e.p
	msg := toMessage(e.r)
	e.State = keywindow.InFlight
	p.inflight++
	// As Watermill's subscribers do, a message's context ends with its ack
	// or nack, and when its partition is abandoned.
	ctx, cancel := context.WithCancel(p.ctx)
	e.cancel = cancel
	msg.SetContext(&recordContext{Context: ctx, r: e.r})
	return msg
}

// await waits for msg's ack or nack; its slot is freed only then (or when
// the Subscriber has closed), even after its partition was revoked, so
// MaxInFlight bounds the handlers running at once.
func (st *stream) await(e *entry, msg *message.Message) {
	defer e.cancel()
	select {
	case <-msg.Acked():
		st.mu.Lock()
		e.p.acked(e)
		st.mu.Unlock()
	case <-msg.Nacked():
		st.mu.Lock()
		e.p.nacked(e)
		st.mu.Unlock()
	case <-st.s.closed:
	}
	<-st.s.slots
}

// commitLoop commits every CommitInterval until the stream ends.
func (st *stream) commitLoop() {
	t := time.NewTicker(st.s.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-st.ctx.Done():
			return
		case <-t.C:
			st.commitMu.Lock()
			st.commit(st.ctx, nil)
			st.commitMu.Unlock()
		}
	}
}

// commit commits the offsets that moved, of the partitions ids (nil: all
// held): with Progress to PostgreSQL first, then to Kafka. Called with
// commitMu held.
func (st *stream) commit(ctx context.Context, ids []int32) {
	offsets := map[int32]kgo.EpochOffset{}
	var positions []position
	progress := st.s.cfg.Progress != nil
	st.mu.Lock()
	add := func(p *part) {
		off := p.commitOffset()
		if off < 0 {
			return
		}
		if off > p.committed {
			offsets[p.id] = kgo.EpochOffset{Epoch: p.epoch, Offset: off}
		}
		if progress && off != p.saved && !st.fenced {
			positions = append(positions, position{p, progresssql.Position{Topic: st.topic, Partition: p.id, Next: off}})
		}
	}
	if ids == nil {
		for _, p := range st.parts {
			add(p)
		}
	} else {
		for _, id := range ids {
			if p := st.parts[id]; p != nil {
				add(p)
			}
		}
	}
	st.mu.Unlock()
	if progress && ids == nil && len(positions) == 0 {
		st.checkTimeline(ctx)
	}
	st.saveProgress(ctx, positions)
	if len(offsets) == 0 {
		return
	}
	var cerr error
	st.cl.CommitOffsetsSync(ctx, map[string]map[int32]kgo.EpochOffset{st.topic: offsets},
		func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
			cerr = err
			if err != nil {
				return
			}
			for _, t := range resp.Topics {
				for _, rp := range t.Partitions {
					if perr := kerr.ErrorForCode(rp.ErrorCode); perr != nil {
						cerr = perr
						delete(offsets, rp.Partition)
					}
				}
			}
		})
	if cerr != nil && ctx.Err() == nil {
		st.logger.Error("Offset commit failed", cerr, nil)
	}
	st.mu.Lock()
	for id, eo := range offsets {
		if p := st.parts[id]; p != nil && eo.Offset > p.committed {
			p.committed = eo.Offset
		}
	}
	st.mu.Unlock()
}
