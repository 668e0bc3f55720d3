package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/kafkactx"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// kafkaMessage is a fresh event as watermill-kafka's subscriber and the
// router hand it out: its topic, partition and offset in its context.
func kafkaMessage(partition int32, offset int64, kept bool) *message.Message {
	ctx := context.WithValue(context.Background(), kafkactx.KeyOf(func(c context.Context) { message.SubscribeTopicFromCtx(c) }), "orders")
	ctx = context.WithValue(ctx, kafkactx.KeyOf(func(c context.Context) { kafka.MessagePartitionFromCtx(c) }), partition)
	ctx = context.WithValue(ctx, kafkactx.KeyOf(func(c context.Context) { kafka.MessagePartitionOffsetFromCtx(c) }), offset)
	if kept {
		ctx = context.WithValue(ctx, progresssql.SubscriberKey{}, true)
	}
	id := uuid.Must(uuid.NewV7())
	msg := message.NewMessage(watermill.NewUUID(), []byte("{}"))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	msg.SetContext(ctx)
	return msg
}

// The claim transaction of a watermill-kafka message records its
// partition's next offset, moving forward only; a subscriber that keeps its
// position itself (SubscriberKey) and SkipProgress record none. A first
// offset past PostgreSQL's position (what a failover leaves) is counted in
// Stats.KafkaAhead, and the position then stays at the gap's start.
func TestProgressKeptWithTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	next := func(part int) int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, "SELECT next_offset FROM processed_event_progress WHERE consumer_group = 'g' AND kafka_partition = $1", part).Scan(&n))
		return n
	}

	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)
	h := d.Middleware(noop)
	for off := int64(0); off < 3; off++ {
		_, err := h(kafkaMessage(0, off, false))
		require.NoError(t, err)
	}
	require.Equal(t, 3, next(0))
	_, err = h(kafkaMessage(0, 1, false)) // an older record again: no rewind
	require.NoError(t, err)
	require.Equal(t, 3, next(0))
	_, err = h(kafkaMessage(1, 0, true)) // kept by its subscriber
	require.NoError(t, err)
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_progress WHERE kafka_partition = 1"))

	skip, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g2", Table: table, SkipProgress: true}, nil)
	require.NoError(t, err)
	_, err = skip.Middleware(noop)(kafkaMessage(2, 0, false))
	require.NoError(t, err)
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_progress WHERE consumer_group = 'g2'"))

	// A new process whose subscriber starts past the position: offsets 3..9 skipped.
	restarted, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)
	for off := int64(10); off < 12; off++ {
		_, err := restarted.Middleware(noop)(kafkaMessage(0, off, false))
		require.NoError(t, err)
	}
	require.Equal(t, uint64(7), restarted.Stats().KafkaAhead)
	require.Equal(t, 3, next(0), "the position stays at the gap's start, for the rewind")
	// Restarted at the position (after the rewind): recorded again.
	rewound, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)
	_, err = rewound.Middleware(noop)(kafkaMessage(0, 3, false))
	require.NoError(t, err)
	require.Zero(t, rewound.Stats().KafkaAhead)
	require.Equal(t, 4, next(0))
}
