package idemkafka

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// progressSaveTimeout bounds one read or write of the positions.
const progressSaveTimeout = 5 * time.Second

// progressStep, when set (by tests only), is called at each step of a
// flush: "collected" (the marks read), "saved" (PostgreSQL holds them,
// Kafka does not yet), "marked" (passed on to Sarama); and with "mark" for
// each mark watermill-kafka makes.
var progressStep func(step string)

func step(name string) {
	if progressStep != nil {
		progressStep(name)
	}
}

// progressKeeper keeps a watermill-kafka subscription's position per
// partition in PostgreSQL (ClientConfig.Progress), one per consumer-group
// handler (one per Subscribe call).
//
// watermill-kafka marks a record's offset once its message is acked, that
// is after the dedup transaction committed. The keeper takes those marks
// from the session it hands watermill-kafka's ConsumeClaim and holds them:
// every flush writes the partitions' positions in one statement, and only
// then passes the marks on to Sarama, which commits them to Kafka. So the
// committed Kafka offset never passes PostgreSQL's position, and no dedup
// transaction carries a write of its own. At Setup, before any record is
// read, every claimed partition with a row starts from it (PostgreSQL wins
// over Kafka's committed offset): after a failover to an asynchronous
// standby or a point-in-time restore, the records of the lost transactions
// are read again instead of being skipped.
type progressKeeper struct {
	db       migrate.DBTX
	table    string
	group    string
	interval time.Duration
	logger   watermill.LoggerAdapter

	flushMu sync.Mutex // one flush at a time

	mu     sync.Mutex
	sess   sarama.ConsumerGroupSession
	tl     int64 // the server's timeline at Setup: a write on another is fenced
	marked map[topicPartition]int64
	saved  map[topicPartition]int64 // PostgreSQL's position, as read or last written
	fenced chan struct{}            // closed when a write found a new timeline
	// endFailed: a flush after the session ended failed (a database gone,
	// each write waiting progressSaveTimeout); the session's other claims
	// skip theirs rather than hold the rejoin one timeout each.
	endFailed bool
}

type topicPartition struct {
	topic     string
	partition int32
}

func newProgressKeeper(cfg ClientConfig, group string, interval time.Duration, logger watermill.LoggerAdapter) *progressKeeper {
	schema, table := claimsql.Names(cfg.ProgressSchema, cfg.ProgressTable)
	return &progressKeeper{db: cfg.Progress, table: progresssql.Table(schema, table), group: group, interval: interval, logger: logger}
}

// setup reads PostgreSQL's positions of the session's claims and moves
// the session's offsets to them, forward or back, before Sarama starts the
// claims' consumers (which take their start from the session then). A
// partition without a row (the group's first run with Progress) keeps
// Kafka's committed offset; its row is written before its first record is
// handed out (ensureRow). An error ends the session: it is joined again,
// never started from Kafka's offset alone.
func (k *progressKeeper) setup(sess sarama.ConsumerGroupSession) error {
	ctx, cancel := context.WithTimeout(sess.Context(), progressSaveTimeout)
	defer cancel()
	rows, tl, err := progresssql.Load(ctx, k.db, k.table, k.group, "")
	if err != nil {
		return err
	}
	claimed := map[topicPartition]bool{}
	for topic, parts := range sess.Claims() {
		for _, p := range parts {
			claimed[topicPartition{topic, p}] = true
		}
	}
	saved := map[topicPartition]int64{}
	for _, r := range rows {
		tp := topicPartition{r.Topic, r.Partition}
		if !claimed[tp] {
			continue
		}
		// ResetOffset moves back only, MarkOffset forward only: one of
		// them sets the offset the partition's consumer starts from.
		sess.ResetOffset(r.Topic, r.Partition, r.Next, "")
		sess.MarkOffset(r.Topic, r.Partition, r.Next, "")
		saved[tp] = r.Next
	}
	k.mu.Lock()
	k.sess, k.tl, k.saved, k.marked, k.fenced, k.endFailed = sess, tl, saved, map[topicPartition]int64{}, make(chan struct{}), false
	fenced := k.fenced
	k.mu.Unlock()
	go k.flushEvery(sess, fenced)
	return nil
}

// flushEvery flushes the marks every interval until the session ends (each
// claim flushes once more as it ends).
func (k *progressKeeper) flushEvery(sess sarama.ConsumerGroupSession, fenced chan struct{}) {
	t := time.NewTicker(k.interval)
	defer t.Stop()
	for {
		select {
		case <-sess.Context().Done():
			return
		case <-fenced:
			return
		case <-t.C:
		}
		if sess.Context().Err() != nil {
			return // the claims' last flushes take over
		}
		k.flush()
	}
}

// mark records that every record of tp below next is settled (its message
// acked, so its transaction committed). Marks move forward only.
func (k *progressKeeper) mark(tp topicPartition, next int64) {
	k.mu.Lock()
	if next > k.marked[tp] {
		k.marked[tp] = next
	}
	k.mu.Unlock()
	step("mark")
}

// hasRow reports whether tp has a row in PostgreSQL (read at Setup or
// written since).
func (k *progressKeeper) hasRow(tp topicPartition) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.saved[tp]
	return ok
}

// ensureRow writes tp's first row, at the offset of the first record it
// hands out, before that record is handed out: a partition whose records
// were processed always has a row, so a failover that loses later writes
// still finds where they started. A write that fails (or is fenced) ends
// the claim.
func (k *progressKeeper) ensureRow(tp topicPartition, offset int64) error {
	if k.hasRow(tp) {
		return nil
	}
	k.mu.Lock()
	tl := k.tl
	k.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), progressSaveTimeout)
	defer cancel()
	fenced, err := progresssql.Save(ctx, k.db, k.table, k.group, tl, []progresssql.Position{{Topic: tp.topic, Partition: tp.partition, Next: offset}})
	switch {
	case err != nil:
		return err
	case fenced:
		k.fence()
		return errProgressFenced
	}
	k.mu.Lock()
	if _, ok := k.saved[tp]; !ok {
		k.saved[tp] = offset
	}
	k.mu.Unlock()
	return nil
}

var errProgressFenced = errors.New("PostgreSQL is on a new timeline (a promoted standby or a restore): the session ends and starts again from its positions")

// fence ends the session's claims: the next session reads the positions
// of the new history.
func (k *progressKeeper) fence() {
	k.mu.Lock()
	defer k.mu.Unlock()
	select {
	case <-k.fenced:
	default:
		close(k.fenced)
	}
}

// fencedC is closed when the current session's positions are fenced.
func (k *progressKeeper) fencedC() <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.fenced
}

// flush writes the partitions whose marks moved since the last write, in
// one statement, then passes those marks on to Sarama: Kafka commits an
// offset only after PostgreSQL holds it. A failed write keeps the marks
// for the next flush (Kafka's offset waits too); a fenced one ends the
// session.
func (k *progressKeeper) flush() {
	k.flushMu.Lock()
	defer k.flushMu.Unlock()
	k.mu.Lock()
	sess, tl := k.sess, k.tl
	ended := sess.Context().Err() != nil
	if ended && k.endFailed {
		k.mu.Unlock()
		return
	}
	var ps []progresssql.Position
	for tp, next := range k.marked {
		if saved, ok := k.saved[tp]; !ok || next > saved {
			ps = append(ps, progresssql.Position{Topic: tp.topic, Partition: tp.partition, Next: next})
		}
	}
	k.mu.Unlock()
	if len(ps) == 0 {
		return
	}
	step("collected")
	ctx, cancel := context.WithTimeout(context.Background(), progressSaveTimeout)
	defer cancel()
	fenced, err := progresssql.Save(ctx, k.db, k.table, k.group, tl, ps)
	switch {
	case err != nil:
		k.logger.Error("Could not save the positions in PostgreSQL (retried at the next flush; Kafka's offsets wait)", err,
			watermill.LogFields{"consumer_group": k.group, "partitions": len(ps)})
		if ended {
			k.mu.Lock()
			k.endFailed = true
			k.mu.Unlock()
		}
		return
	case fenced:
		k.logger.Error("Positions not saved", errProgressFenced, watermill.LogFields{"consumer_group": k.group})
		k.fence()
		return
	}
	step("saved")
	k.mu.Lock()
	for _, p := range ps {
		k.saved[topicPartition{p.Topic, p.Partition}] = p.Next
	}
	k.mu.Unlock()
	for _, p := range ps {
		sess.MarkOffset(p.Topic, p.Partition, p.Next, "")
	}
	step("marked")
}

// markingSession is the session watermill-kafka's ConsumeClaim gets: its
// marks go to the keeper, which passes them on once PostgreSQL holds them.
type markingSession struct {
	sarama.ConsumerGroupSession
	k *progressKeeper
}

func (s markingSession) MarkMessage(msg *sarama.ConsumerMessage, _ string) {
	s.k.mark(topicPartition{msg.Topic, msg.Partition}, msg.Offset+1)
}

func (s markingSession) MarkOffset(topic string, partition int32, offset int64, _ string) {
	s.k.mark(topicPartition{topic, partition}, offset)
}

// Commit flushes the marks to PostgreSQL first (watermill-kafka calls it
// after each mark when Sarama's auto-commit is off).
func (s markingSession) Commit() {
	s.k.flush()
	s.ConsumerGroupSession.Commit()
}
