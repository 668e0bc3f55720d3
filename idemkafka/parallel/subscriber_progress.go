package parallel

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// progressSaveTimeout bounds one write of the positions.
const progressSaveTimeout = 5 * time.Second

// progressTable is the quoted <table>_progress of cfg.Progress.
func (c SubscriberConfig) progressTable() string {
	schema, table := claimsql.Names(c.ProgressSchema, c.ProgressTable)
	return progresssql.Table(schema, table)
}

// loadProgress reads PostgreSQL's positions of the claimed partitions and
// moves the session's offsets to them, forward or back: PostgreSQL wins
// over the committed Kafka offset (which the session then commits). It
// returns the done runs above each position. A partition without a row
// (the group's first run with Progress) keeps its Kafka offset. An error
// ends the session: it is joined again, never started from Kafka's offset
// alone.
func (st *stream) loadProgress(sess sarama.ConsumerGroupSession, parts []int32) (map[int32][]run, error) {
	s := st.s
	ctx, cancel := context.WithTimeout(sess.Context(), progressSaveTimeout)
	defer cancel()
	rows, tl, err := progresssql.Load(ctx, s.cfg.Progress, s.cfg.progressTable(), s.cfg.ConsumerGroup, st.topic)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	st.timeline = tl
	s.mu.Unlock()
	claimed := make(map[int32]bool, len(parts))
	for _, part := range parts {
		claimed[part] = true
	}
	out := make(map[int32][]run, len(parts))
	for _, r := range rows {
		if !claimed[r.Partition] {
			continue
		}
		// ResetOffset moves back only, MarkOffset forward only: one of
		// them sets the offset the partition's consumer starts from.
		sess.ResetOffset(st.topic, r.Partition, r.Next, r.Done)
		sess.MarkOffset(st.topic, r.Partition, r.Next, r.Done)
		out[r.Partition] = decodeDone(r.Next, r.Done, s.cfg.PartitionWindow)
		delete(claimed, r.Partition)
		st.logger.Debug("Partition starts from PostgreSQL's position", watermill.LogFields{"kafka_partition": r.Partition, "offset": r.Next})
	}
	for part := range claimed {
		st.logger.Info("No position in PostgreSQL yet: the partition starts from Kafka's committed offset", watermill.LogFields{"kafka_partition": part})
	}
	return out, nil
}

// recordStart writes where claim starts to PostgreSQL when its partition
// has no position there yet, before any of its records is handed out
// (progresssql.Start): a partition whose first position would be written
// after a replication cut (a retry topic's, which gets its first record
// late) still has one on the promoted standby, so it starts there and not
// from Kafka's committed offset, past the records whose transactions the
// standby lost. An error ends the session, as loadProgress's does.
func (st *stream) recordStart(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	s := st.s
	if s.cfg.Progress == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(sess.Context(), progressSaveTimeout)
	defer cancel()
	if err := progresssql.Start(ctx, s.cfg.Progress, s.cfg.progressTable(), s.cfg.ConsumerGroup, st.topic, claim.Partition(), claim.InitialOffset()); err != nil {
		return fmt.Errorf("parallel: %w", err)
	}
	return nil
}

// saveProgress writes p's marked offset and done runs to PostgreSQL when
// they changed since the last write, after the acks they cover (whose
// transactions committed before). It reports fenced when the server is no
// longer on the timeline of the session's start (a promoted standby, a
// restore): then the session must end, so that the next one starts from
// the new history's position.
func (p *partState) saveProgress() (fenced bool) {
	st := p.st
	s := st.s
	if s.cfg.Progress == nil {
		return false
	}
	s.mu.Lock()
	pos := progresssql.Position{Topic: st.topic, Partition: p.partition, Next: p.marked, Done: p.meta}
	tl := st.timeline
	same := pos.Next == p.savedNext && pos.Done == p.savedDone
	s.mu.Unlock()
	if pos.Next < 0 || same {
		return false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(st.ctx), progressSaveTimeout)
	defer cancel()
	fenced, err := progresssql.Save(ctx, s.cfg.Progress, s.cfg.progressTable(), s.cfg.ConsumerGroup, tl, []progresssql.Position{pos})
	fields := watermill.LogFields{"kafka_partition": p.partition, "offset": pos.Next}
	switch {
	case err != nil:
		st.logger.Error("Could not save the position in PostgreSQL (retried at the next commit)", err, fields)
		return false
	case fenced:
		st.logger.Error("PostgreSQL is on a new timeline (a promoted standby or a restore): the session ends and starts again from its position",
			errors.New("progress fenced"), fields)
		return true
	}
	s.mu.Lock()
	p.savedNext, p.savedDone = pos.Next, pos.Done
	s.mu.Unlock()
	return false
}
