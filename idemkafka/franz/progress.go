package franz

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// progressSaveTimeout bounds one read or write of the positions in
// PostgreSQL ([SubscriberConfig].Progress).
const progressSaveTimeout = 5 * time.Second

// progressRetrySleep is how long a restart whose read of the positions
// failed waits before the next attempt.
const progressRetrySleep = time.Second

// progressTable is the quoted <table>_progress of c.Progress.
func (c SubscriberConfig) progressTable() string {
	schema, table := claimsql.Names(c.ProgressSchema, c.ProgressTable)
	return progresssql.Table(schema, table)
}

// loadProgress reads the group's positions on the stream's topic and the
// server's timeline.
func (st *stream) loadProgress(ctx context.Context) ([]progresssql.Position, int64, error) {
	ctx, cancel := context.WithTimeout(ctx, progressSaveTimeout)
	defer cancel()
	cfg := st.s.cfg
	return progresssql.Load(ctx, cfg.Progress, cfg.progressTable(), cfg.ConsumerGroup, st.topic)
}

// adjustOffsets is the client's AdjustFetchOffsetsFn: franz-go calls it
// on every assignment (classic cooperative-sticky and KIP-848 alike) with
// the offsets it fetched from Kafka for the partitions the member gained,
// after OnPartitionsAssigned and before their first fetch, and starts the
// partitions at what it returns. A partition with a row in PostgreSQL
// starts there, forward or back: PostgreSQL wins. One without (the
// group's first run with Progress) keeps Kafka's offset, which is written
// as its row first (progresssql.Start; 0 for a group without a committed
// offset): a partition whose first position would come after a
// replication cut (a retry topic's, first used late) still has one on the
// promoted standby. An error makes franz-go drop the assignment and
// rejoin: a partition never starts from Kafka's offset alone because
// PostgreSQL could not be read.
func (st *stream) adjustOffsets(ctx context.Context, offsets map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	gained := offsets[st.topic]
	if len(gained) == 0 {
		return offsets, nil
	}
	rows, tl, err := st.loadProgress(ctx)
	if err == nil {
		err = st.recordStarts(ctx, gained, rows)
	}
	if err != nil {
		st.logger.Error("Could not read or write the positions in PostgreSQL: the member rejoins the group", err, nil)
		return nil, err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	for id := range gained {
		p := st.parts[id]
		if p == nil { // OnPartitionsAssigned made it; never nil in practice
			p = newPart(st, id)
			st.parts[id] = p
		}
		p.timeline = tl
	}
	for _, r := range rows {
		if _, ok := gained[r.Partition]; !ok {
			continue
		}
		gained[r.Partition] = kgo.NewOffset().At(r.Next).WithEpoch(-1)
		st.parts[r.Partition].saved = r.Next
		st.logger.Debug("Partition starts from PostgreSQL's position", watermill.LogFields{"kafka_partition": r.Partition, "offset": r.Next})
	}
	for id := range gained {
		if st.parts[id].saved < 0 {
			st.logger.Info("No position in PostgreSQL yet: the partition starts from Kafka's committed offset, recorded as its position", watermill.LogFields{"kafka_partition": id})
		}
	}
	return offsets, nil
}

// recordStarts writes, for each partition of gained without a row in
// rows, the offset it starts from as its row (progresssql.Start: a row
// written meanwhile is left alone).
func (st *stream) recordStarts(ctx context.Context, gained map[int32]kgo.Offset, rows []progresssql.Position) error {
	cfg := st.s.cfg
	for id, off := range gained {
		if slices.ContainsFunc(rows, func(r progresssql.Position) bool { return r.Partition == id }) {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, progressSaveTimeout)
		err := progresssql.Start(sctx, cfg.Progress, cfg.progressTable(), cfg.ConsumerGroup, st.topic, id, off.EpochOffset().Offset)
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

// position is a partition's position to write.
type position struct {
	p   *part
	pos progresssql.Position
}

// saveProgress writes ps to PostgreSQL, each on the timeline its
// partition's position was read on, after the acks they cover (whose
// transactions committed before). A write finding the server on another
// timeline (a promoted standby, a restore) fences the stream: its
// partitions restart from the new history's position (restart). Errors are
// logged; the positions are written again at the next commit.
func (st *stream) saveProgress(ctx context.Context, ps []position) {
	if len(ps) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), progressSaveTimeout)
	defer cancel()
	cfg := st.s.cfg
	byTimeline := map[int64][]position{}
	for _, p := range ps {
		byTimeline[p.p.timeline] = append(byTimeline[p.p.timeline], p)
	}
	for tl, ps := range byTimeline {
		rows := make([]progresssql.Position, len(ps))
		for i, p := range ps {
			rows[i] = p.pos
		}
		fenced, err := progresssql.Save(ctx, cfg.Progress, cfg.progressTable(), cfg.ConsumerGroup, tl, rows)
		switch {
		case err != nil:
			st.logger.Error("Could not save the positions in PostgreSQL (retried at the next commit)", err, nil)
			continue
		case fenced:
			st.logger.Error("PostgreSQL is on a new timeline (a promoted standby or a restore): the partitions start again from its position",
				errors.New("progress fenced"), nil)
			st.fence()
			continue
		}
		st.mu.Lock()
		for _, p := range ps {
			p.p.saved = max(p.p.saved, p.pos.Next)
		}
		st.mu.Unlock()
	}
}

// checkTimeline, on a periodic commit with no position to write (an idle
// member), compares the server's timeline with the one the partitions'
// positions were read on, and fences the stream when it moved: a member
// behind a moved address (a promoted standby, a restore) then goes back to
// the new history's position without waiting for a record to write, and
// before it hands out the next ones. One query per CommitInterval, only
// while idle.
func (st *stream) checkTimeline(ctx context.Context) {
	st.mu.Lock()
	var seen []int64
	for _, p := range st.parts {
		if p.timeline != 0 && !slices.Contains(seen, p.timeline) {
			seen = append(seen, p.timeline)
		}
	}
	fenced := st.fenced
	st.mu.Unlock()
	if len(seen) == 0 || fenced {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), progressSaveTimeout)
	defer cancel()
	tl, err := progresssql.Timeline(ctx, st.s.cfg.Progress)
	if err != nil || tl == 0 || (len(seen) == 1 && seen[0] == tl) {
		return // unreadable or a standby: the next write or check decides
	}
	st.logger.Error("PostgreSQL is on a new timeline (a promoted standby or a restore): the partitions start again from its position",
		errors.New("progress fenced"), watermill.LogFields{"timeline": tl, "read_on": seen})
	st.fence()
}

// fence stops handing out the stream's records and wakes the poll loop,
// which restarts the partitions.
func (st *stream) fence() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.fenced {
		return
	}
	st.fenced = true
	for _, p := range st.parts {
		p.stop()
	}
	if st.pollCancel != nil {
		st.pollCancel()
	}
}

// restart, in the poll loop while no rebalance can run, starts the
// partitions of a fenced stream again: their messages in flight get
// RevokeTimeout, their windows are dropped, and each starts from the new
// history's position in PostgreSQL (one without a row there from its old
// commit offset, as a rejoin would start it from Kafka's). It reports
// false, after progressRetrySleep, when PostgreSQL could not be read: the
// next poll tries again.
func (st *stream) restart() bool {
	rows, tl, err := st.loadProgress(st.ctx)
	if err != nil {
		st.logger.Error("Could not read the positions in PostgreSQL after a new timeline (retried)", err, nil)
		select {
		case <-time.After(progressRetrySleep):
		case <-st.ctx.Done():
		}
		return false
	}
	st.mu.Lock()
	ids := make([]int32, 0, len(st.parts))
	from := map[int32]int64{}
	for id, p := range st.parts {
		ids = append(ids, id)
		if off := max(p.commitOffset(), p.committed); off >= 0 {
			from[id] = off
		}
	}
	st.mu.Unlock()
	st.release(st.ctx, ids, true, false)
	st.mu.Lock()
	for _, id := range ids {
		p := newPart(st, id)
		p.timeline = tl
		st.parts[id] = p
	}
	for _, r := range rows {
		if p := st.parts[r.Partition]; p != nil && slices.Contains(ids, r.Partition) {
			from[r.Partition] = r.Next
			p.saved = r.Next
		}
	}
	set := make(map[int32]kgo.EpochOffset, len(from))
	for id, off := range from {
		set[id] = kgo.EpochOffset{Epoch: -1, Offset: off}
	}
	st.fenced = false
	st.mu.Unlock()
	st.cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{st.topic: set})
	st.logger.Info("Partitions restarted from PostgreSQL's position on its new timeline", watermill.LogFields{"offsets": from})
	return true
}
