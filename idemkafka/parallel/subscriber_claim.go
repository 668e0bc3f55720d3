package parallel

import (
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
)

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
