package franz

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kgo"
)

// assigned starts a window for each partition the group gave the member.
func (st *stream) assigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, id := range assigned[st.topic] {
		if st.parts[id] == nil {
			st.parts[id] = newPart(st, id)
		}
	}
	st.logger.Debug("Partitions assigned", watermill.LogFields{"partitions": assigned[st.topic]})
}

// revoked gives the revoked partitions' messages in flight RevokeTimeout
// to be acked, commits, and drops the partitions (under cooperative-sticky
// and KIP-848 only the partitions that move).
func (st *stream) revoked(ctx context.Context, _ *kgo.Client, revoked map[string][]int32) {
	st.release(ctx, revoked[st.topic], true, true)
}

// lost drops the partitions without waiting or committing: the member
// was fenced or expelled, another member owns them already.
func (st *stream) lost(ctx context.Context, _ *kgo.Client, lost map[string][]int32) {
	st.release(ctx, lost[st.topic], false, false)
}

// release stops the partitions ids, with wait waits for their messages in
// flight up to RevokeTimeout, and commits when commit is set; then the
// messages still in flight are abandoned (their contexts cancelled) and
// the partitions forgotten.
func (st *stream) release(ctx context.Context, ids []int32, wait, commit bool) {
	if len(ids) == 0 {
		return
	}
	var parts []*part
	st.mu.Lock()
	for _, id := range ids {
		if p := st.parts[id]; p != nil {
			p.stop()
			parts = append(parts, p)
		}
	}
	st.mu.Unlock()
	if wait {
		deadline := time.NewTimer(st.s.cfg.RevokeTimeout)
		defer deadline.Stop()
	wait:
		for _, p := range parts {
			select {
			case <-p.drained:
			case <-deadline.C:
				break wait
			case <-ctx.Done():
				break wait
			}
		}
	}
	if commit {
		st.commitMu.Lock()
		// The final commit runs even when the stream is ending.
		st.commit(context.WithoutCancel(ctx), ids)
		st.commitMu.Unlock()
	}
	st.mu.Lock()
	for _, p := range parts {
		p.end()
		// Only the messages still in flight stay referenced (by their
		// awaiting goroutines, up to MaxInFlight): the rest of the
		// window goes.
		p.win.Release()
		if p.paused {
			st.cl.ResumeFetchPartitions(map[string][]int32{st.topic: {p.id}})
		}
		if st.parts[p.id] == p {
			delete(st.parts, p.id)
		}
	}
	st.mu.Unlock()
	st.logger.Debug("Partitions released", watermill.LogFields{"partitions": ids, "committed": commit})
}
