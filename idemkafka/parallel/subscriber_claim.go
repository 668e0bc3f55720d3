package parallel

import (
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// groupHandler is the sarama.ConsumerGroupHandler of a stream.
//
// Under an eager strategy each rebalance ends the session: Setup runs for
// every generation with all its claims. Under cooperative-sticky one
// session lives across rebalances: Setup runs once, a revoked partition
// has its Messages channel closed (its ConsumeClaim returns, the others
// keep running), and a partition added later gets a ConsumeClaim without a
// Setup, so it reads its own commit metadata.
type groupHandler struct {
	st *stream

	mu   sync.Mutex
	skip map[int32][]run // per partition claimed at Setup and not started yet
}

// Setup reads the commit metadata of the claimed partitions: the offsets
// above the committed one that are done already.
func (h *groupHandler) Setup(sess sarama.ConsumerGroupSession) error {
	h.st.s.mu.Lock()
	h.st.s.stats.sessions++
	h.st.s.mu.Unlock()
	parts := sess.Claims()[h.st.topic]
	skip := make(map[int32][]run, len(parts))
	for _, part := range parts {
		skip[part] = nil
	}
	if len(parts) > 0 && h.st.s.cfg.Progress != nil {
		done, err := h.st.loadProgress(sess, parts)
		if err != nil {
			return fmt.Errorf("parallel: read the positions in PostgreSQL: %w", err)
		}
		maps.Copy(skip, done)
	} else if len(parts) > 0 && h.st.s.cfg.CommitMetadataMaxBytes >= 0 {
		if done, err := h.st.fetchDone(parts); err != nil {
			// Only an optimization: the records run again, their claims absorb it.
			h.st.logger.Info("Could not read the commit metadata, done records above the committed offsets run again", watermill.LogFields{"err": err.Error()})
		} else {
			maps.Copy(skip, done)
		}
	}
	h.mu.Lock()
	h.skip = skip
	h.mu.Unlock()
	return nil
}

// skipOf returns the done offsets above the committed one of partition:
// read at Setup for a partition claimed then, read now for one added by a
// cooperative rebalance (or claimed again after being revoked).
func (h *groupHandler) skipOf(partition int32) []run {
	h.mu.Lock()
	skip, ok := h.skip[partition]
	delete(h.skip, partition)
	h.mu.Unlock()
	if ok || h.st.s.cfg.CommitMetadataMaxBytes < 0 {
		return skip
	}
	done, err := h.st.fetchDone([]int32{partition})
	if err != nil {
		h.st.logger.Info("Could not read the commit metadata, done records above the committed offset run again",
			watermill.LogFields{"err": err.Error(), "kafka_partition": partition})
		return nil
	}
	return done[partition]
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (h *groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim reads the partition into its window while the window has
// room, marks the committed offset on a timer, and on revocation (the
// session's end, or the claim's Messages closing under a cooperative
// rebalance) gives the messages in flight RevokeTimeout before the final
// mark.
//
// While the window is full it keeps reading the claim, into a queue that
// pauses the partition's fetching, so that it sees Messages close: a
// cooperative rebalance tells a revoked partition only that way, and waits
// for its ConsumeClaim to return. The queue holds at most what Sarama had
// fetched before the pause (Consumer.ChannelBufferSize records, plus one
// fetch response).
func (h *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	st := h.st
	s := st.s
	if err := st.recordStart(sess, claim); err != nil {
		return err
	}
	p := s.newPartState(st, sess, claim, h.skipOf(claim.Partition()))
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
	// Sarama's consumer keeps a partition's pause while the partition is
	// reassigned: one revoked with its window full would come back paused,
	// and never be fetched again.
	q := &claimQueue{claim: claim, group: st.group, topic: st.topic, paused: true}
	q.resume()
	defer q.unpause()
	// blockAt wakes the loop when a full window's slow head would count
	// as blocked, so that its key's records are spilled then.
	blockAt := time.NewTimer(time.Hour)
	blockAt.Stop()
	defer blockAt.Stop()
	msgs := claim.Messages()
	done := sess.Context().Done()
	for {
		s.mu.Lock()
		full := q.feed(p)
		wait := time.Duration(-1)
		if full {
			wait = p.untilBlocked(time.Now())
		}
		s.mu.Unlock()
		if !full {
			q.resume()
		}
		if wait >= 0 {
			blockAt.Reset(wait)
		} else {
			blockAt.Stop()
		}
		select {
		case <-blockAt.C:
		case m, ok := <-msgs:
			if !ok {
				return nil
			}
			if full {
				q.hold(m)
				continue
			}
			s.mu.Lock()
			p.add(m)
			s.mu.Unlock()
		case <-p.space:
		case <-tick.C:
			s.mu.Lock()
			p.mark()
			s.mu.Unlock()
			if p.saveProgress() {
				return nil // a new timeline: the session ends, the next one reads the positions again
			}
			p.logStalls()
		case <-done:
			return nil
		}
	}
}

// claimQueue is what a partition's ConsumeClaim read while its window was
// full, with the partition's fetching paused.
type claimQueue struct {
	claim  sarama.ConsumerGroupClaim
	group  sarama.ConsumerGroup
	topic  string
	held   []*sarama.ConsumerMessage
	paused bool
}

// feed moves the queued records into p's window while it has room, and
// reports whether the window is full. Called with mu held.
func (q *claimQueue) feed(p *partState) (full bool) {
	for {
		if p.full() && !p.spill() {
			return true
		}
		if len(q.held) == 0 {
			q.held = nil
			return false
		}
		p.add(q.held[0])
		q.held[0] = nil
		q.held = q.held[1:]
	}
}

// hold queues m, read while the window was full, and pauses the
// partition's fetching.
func (q *claimQueue) hold(m *sarama.ConsumerMessage) {
	q.held = append(q.held, m)
	if !q.paused {
		q.paused = true
		q.group.Pause(map[string][]int32{q.topic: {q.claim.Partition()}})
	}
}

// resume lets the partition's fetching go on once the queue is empty.
func (q *claimQueue) resume() {
	if len(q.held) == 0 {
		q.unpause()
	}
}

// unpause lets the partition's fetching go on.
func (q *claimQueue) unpause() {
	if q.paused {
		q.paused = false
		q.group.Resume(map[string][]int32{q.topic: {q.claim.Partition()}})
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
	p.win.Stop(func(e *entry) {
		if e.State == keywindow.Held {
			s.stats.held--
		}
		if e.timer != nil {
			// A held or backing-off record's timer would keep the
			// window, payloads included, until it fires (hours, with long
			// back-offs).
			e.timer.Stop()
			e.timer = nil
		}
	})
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
	s.mu.Unlock()
	p.saveProgress()
	s.mu.Lock()
	if s.onRevoke != nil {
		s.onRevoke(p.partition)
	}
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
	p.win.Release()
	p.skip = nil
	s.mu.Unlock()
	p.cancel()
}

// fetchDone reads the committed offsets and metadata of parts from the
// group coordinator.
func (st *stream) fetchDone(parts []int32) (map[int32][]run, error) {
	s := st.s
	b, err := st.client.Coordinator(s.cfg.ConsumerGroup)
	if err != nil {
		return nil, err
	}
	req := sarama.NewOffsetFetchRequest(s.sarama.Version, s.cfg.ConsumerGroup, map[string][]int32{st.topic: parts})
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
		if done := decodeDone(blk.Offset, blk.Metadata, s.cfg.PartitionWindow); len(done) > 0 {
			out[part] = done
		}
	}
	return out, nil
}
