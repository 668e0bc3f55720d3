package bench

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/internal/kafkactx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() {
	Register("dedup-progress", dedupProgress)
}

// The unexported context keys of watermill-kafka and Watermill, learnt
// by asking their accessors (internal/kafkactx), so the benchmark's
// messages carry a Kafka position as watermill-kafka's do.
var (
	ctxPartition = kafkactx.KeyOf(func(ctx context.Context) { kafka.MessagePartitionFromCtx(ctx) })
	ctxOffset    = kafkactx.KeyOf(func(ctx context.Context) { kafka.MessagePartitionOffsetFromCtx(ctx) })
	ctxTopic     = kafkactx.KeyOf(func(ctx context.Context) { message.SubscribeTopicFromCtx(ctx) })
)

// partitions hands each call a partition of its own for its duration, with
// the partition's next offset: one message in flight per partition, as
// watermill-kafka's subscriber has.
type partitions chan *partitionNext

type partitionNext struct {
	partition int32
	offset    int64
}

func newPartitions(n int) partitions {
	p := make(partitions, n)
	for i := range n {
		p <- &partitionNext{partition: int32(i)}
	}
	return p
}

// op runs h on a fresh event carrying the Kafka position of a free
// partition.
func (ps partitions) op(h message.HandlerFunc) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		p := <-ps
		defer func() { ps <- p }()
		ctx = context.WithValue(context.WithValue(context.WithValue(ctx, ctxPartition, p.partition), ctxOffset, p.offset), ctxTopic, "orders")
		p.offset++
		msg, _ := newEventMessage(ctx)
		_, err := h(msg)
		return err
	}
}

// dedupProgress measures what keeping the consumer group's position with
// the claims costs in transaction mode (DESIGN §12): the dedup middleware
// on messages of watermill-kafka's subscriber, with the progress upsert
// queued in the claim's batch, against the same with SkipProgress.
func dedupProgress(ctx context.Context, o Options) (Section, error) {
	rig, err := newDedupRig(ctx, o, "progress", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	skip, err := idem.NewDedup(idem.Config{DB: rig.db.Pool, ConsumerGroup: "bench", Table: rig.table, SkipProgress: true}, nil)
	if err != nil {
		return Section{}, err
	}
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	var rows [][]string
	for _, w := range []int{1, 4, 16} {
		// A partition set per variant: each sees its partitions' offsets in
		// sequence (a jump would make the middleware compare it with
		// PostgreSQL's position, a query).
		ops := []func(context.Context) error{newPartitions(w).op(skip.Middleware(rig.handler)), newPartitions(w).op(rig.deduped)}
		if _, err := Interleave(ctx, 1, w, 200*time.Millisecond, ops...); err != nil { // warm-up
			return Section{}, err
		}
		rates, err := Interleave(ctx, rounds, w, d, ops...)
		if err != nil {
			return Section{}, err
		}
		r := Summarise(Ratios(rates[0], rates[1]))
		o.Logf("  dedup-progress workers=%d: without %s msg/s, with %s msg/s, ratio %s", w, fmtRate(rates[0]), fmtRate(rates[1]), r)
		rows = append(rows, []string{fmt.Sprint(w), fmtRate(rates[0]), fmtRate(rates[1]), r.String(), pass(r.Median >= 0.95)})
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workers (= partitions)", "without progress (msg/s, median)", "with progress (msg/s, median)", "ratio with/without", "median ≥ 0.95"}, rows))
	fmt.Fprintf(&b, "\nBoth: the dedup middleware in transaction mode on fresh UUIDv7 events carrying a Kafka position as watermill-kafka's subscriber's do, "+
		"one message in flight per partition. With progress the claim's pipelined batch also upserts the partition's row of `processed_event_progress` "+
		"(no round trip added); without: `Config.SkipProgress`. Interleaved call by call; %d rounds of %s; median and (min–max) over rounds.\n", rounds, d)
	return Section{Title: "Progress kept with the claim: dedup middleware with and without", Markdown: b.String()}, nil
}
