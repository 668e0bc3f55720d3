package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/claimstart"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// progressKeeper keeps the consumer group's Kafka position with the
// claims (DESIGN §12) for the messages of watermill-kafka's subscriber.
type progressKeeper struct {
	db     migrate.Beginner
	table  string // quoted <table>_progress
	group  string
	stats  *counters
	logger watermill.LoggerAdapter
	watch  progressWatch
}

// newProgressKeeper returns the keeper of cfg, nil with SkipProgress.
func newProgressKeeper(cfg Config, stats *counters, logger watermill.LoggerAdapter) *progressKeeper {
	if cfg.SkipProgress {
		return nil
	}
	schema, table := claimsql.Names(cfg.Table.Schema, cfg.Table.Table)
	d := &progressKeeper{db: cfg.DB, table: progresssql.Table(schema, table), group: cfg.ConsumerGroup, stats: stats, logger: logger}
	if cfg.lease() != nil {
		return d // lease mode records no position yet: no start either
	}
	owner := d.table + "\x00" + d.group
	for _, kg := range append([]string{cfg.ConsumerGroup}, cfg.KafkaGroups...) {
		claimstart.Watch(kg, owner, d.recordStart)
	}
	return d
}

// recordStart writes where a claim of watermill-kafka's subscriber starts
// as its partition's position when it has none (progresssql.Start), before
// the claim's first record is handed out. A failure is logged: the
// partition is consumed all the same, and its first claim transaction
// writes the position.
func (d *progressKeeper) recordStart(ctx context.Context, topic string, partition int32, offset int64) {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	err := pgx.BeginFunc(ctx, d.db, func(tx pgx.Tx) error {
		return progresssql.Start(ctx, tx, d.table, d.group, topic, partition, offset)
	})
	if err != nil {
		d.logger.Error("Could not write the partition's start to PostgreSQL", err,
			watermill.LogFields{"topic": topic, "kafka_partition": partition, "offset": offset, "consumer_group": d.group})
	}
}

// startTimeout bounds recordStart.
const startTimeout = 5 * time.Second

// progressContext returns ctx carrying the write of the consumer group's
// progress that the claim transaction of msgs makes (DESIGN §12): for each
// message of watermill-kafka's subscriber, the next offset of its
// partition, in the claim's own round trip and commit. Every mode calls it
// on the context it claims with. Messages without a Kafka position, and
// those of a subscriber that keeps its progress itself (the parallel
// subscriber, and idemkafka's watermill-kafka subscriber with
// ClientConfig.Progress), add nothing; so does [Config.SkipProgress] (a
// nil d).
func (d *progressKeeper) progressContext(ctx context.Context, msgs ...*message.Message) context.Context {
	if d == nil {
		return ctx
	}
	var p *progresssql.Pending
	for _, msg := range msgs {
		mctx := msg.Context()
		if progresssql.KeptBySubscriber(mctx) {
			continue
		}
		part, ok := kafka.MessagePartitionFromCtx(mctx)
		off, ok2 := kafka.MessagePartitionOffsetFromCtx(mctx)
		topic := message.SubscribeTopicFromCtx(mctx)
		if !ok || !ok2 || topic == "" {
			continue
		}
		start, exact := claimstart.Lookup(d.group, topic, part)
		if exact && start.Kept {
			continue // idemkafka's subscriber keeps it (ClientConfig.Progress)
		}
		if d.checkProgress(ctx, topic, part, off, start, exact) {
			continue // PostgreSQL keeps the start of the gap, for the rewind
		}
		if p == nil {
			p = progresssql.NewPending(d.table, d.group)
		}
		p.Add(topic, part, off)
	}
	return progresssql.With(ctx, p)
}

// progressWatch is what the keeper saw per partition of watermill-kafka's
// messages.
type progressWatch struct {
	mu sync.Mutex
	// last is the last offset seen; claim the claim (internal/claimstart)
	// whose start was compared last.
	last  map[topicPartition]int64
	claim map[topicPartition]uint64
	// gap holds the partitions found past PostgreSQL's position: their
	// position is no longer written, so that it stays at the start of the
	// gap, where idemctl's rewind takes the offsets, until this process
	// sees the partition start at its position again.
	gap map[topicPartition]bool
}

type topicPartition struct {
	topic     string
	partition int32
}

// checkProgress compares where the subscriber started on offset's
// partition with PostgreSQL's position there, once per claim, and reports
// whether the partition is past it. A start past the position means that
// the subscriber started from a committed Kafka offset ahead of the
// database, which a failover to an asynchronous standby or a restore
// leaves, and the records between may never be processed: it counts them
// in [Stats].KafkaAhead, logs an error with the rewind to run, and stops
// moving the partition's position (it stays at the start of the gap,
// which the rewind reads). One query, only then.
//
// Where the subscriber started is the claim's start, which
// idemkafka.WatermillSubscriberConfig's subscriber records
// (internal/claimstart): a new claim is compared once. Without it, the
// keeper compares the partition's first offset in this process and each
// jump (offset not following the last one seen), which a topic written in
// Kafka transactions also shows where nothing was lost (a commit marker,
// an aborted transaction's records): such a topic then reads as ahead.
func (d *progressKeeper) checkProgress(ctx context.Context, topic string, partition int32, offset int64, start claimstart.Start, exact bool) (gap bool) {
	key := topicPartition{topic, partition}
	w := &d.watch
	w.mu.Lock()
	if w.last == nil {
		w.last, w.claim, w.gap = map[topicPartition]int64{}, map[topicPartition]uint64{}, map[topicPartition]bool{}
	}
	last, seen := w.last[key]
	w.last[key] = offset
	compared := w.claim[key]
	gap = w.gap[key]
	w.mu.Unlock()
	from := offset
	switch {
	case exact && compared == start.Claim:
		return gap // this claim's start was compared
	case exact:
		from = start.Offset
	case seen && (offset == last+1 || offset <= last):
		return gap
	}
	var next int64
	err := pgx.BeginFunc(ctx, d.db, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT next_offset FROM "+d.table+
			" WHERE consumer_group = $1 AND topic = $2 AND kafka_partition = $3", d.group, topic, partition).Scan(&next)
	})
	fields := watermill.LogFields{"topic": topic, "kafka_partition": partition, "offset": from}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		next = from // the group's first message here with progress
	case err != nil:
		d.logger.Info("Could not compare the Kafka position with PostgreSQL's", fields.Add(watermill.LogFields{"err": err.Error()}))
		return gap
	}
	gap = from > next
	w.mu.Lock()
	w.gap[key] = gap
	if exact {
		w.claim[key] = start.Claim
	}
	w.mu.Unlock()
	if gap {
		d.stats.kafkaAhead.Add(uint64(from - next))
		d.logger.Error("The subscriber started past the consumer group's position in PostgreSQL: records may never be processed",
			fmt.Errorf("offsets %d..%d of %s/%d are not covered by PostgreSQL's position (a failover to an asynchronous standby, or a restore?); "+
				"the position stays there: stop the consumers and run idemctl groups progress %s --rewind --yes", next, from-1, topic, partition, d.group),
			fields.Add(watermill.LogFields{"postgres_offset": next}))
	}
	return gap
}
