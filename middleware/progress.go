package middleware

import (
	"context"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// progressContext returns ctx carrying the write of the consumer group's
// progress that the claim transaction of msgs makes (DESIGN §12): for each
// message of watermill-kafka's subscriber, the next offset of its
// partition, in the claim's own round trip and commit. Every mode calls it
// on the context it claims with. Messages without a Kafka position, and
// those of a subscriber that keeps its progress itself (the parallel
// subscriber), add nothing; so does [Config.SkipProgress].
func (d *Dedup) progressContext(ctx context.Context, msgs ...*message.Message) context.Context {
	if d.cfg.SkipProgress {
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
		if p == nil {
			schema, table := claimsql.Names(d.cfg.Table.Schema, d.cfg.Table.Table)
			p = progresssql.NewPending(progresssql.Table(schema, table), d.cfg.ConsumerGroup)
		}
		p.Add(topic, part, off)
	}
	return progresssql.With(ctx, p)
}
