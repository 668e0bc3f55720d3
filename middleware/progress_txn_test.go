package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A topic written in Kafka transactions (as the outbox forwarder writes)
// holds a commit marker after each transaction's records, so its offsets
// jump where nothing was lost. Consumed by watermill-kafka's subscriber
// (idemkafka.WatermillSubscriberConfig), stopped and started again, the
// middleware finds the subscriber at PostgreSQL's position: nothing counts
// as ahead, and the position keeps following the records (a first record's
// offset compared with the position, as before, read every restart as a
// gap and froze the position there).
func TestProgressOnATransactionalTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "txn", 1)
	db := pgtest.New(t, 8)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))

	prod, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: broker.Addrs, TransactionalID: "progress-" + topic})
	require.NoError(t, err)
	t.Cleanup(func() { _ = prod.Close() })
	// send writes n transactions of 3 records each.
	send := func(n int) {
		for range n {
			require.NoError(t, prod.BeginTxn())
			var msgs []*sarama.ProducerMessage
			for range 3 {
				msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"), Value: sarama.StringEncoder("{}"),
					Headers: []sarama.RecordHeader{{Key: []byte(publisher.MetadataEventID), Value: []byte(publisher.NewEventID().String())}}})
			}
			require.NoError(t, prod.SendMessages(msgs))
			require.NoError(t, prod.CommitTxn())
		}
	}
	position := func() int64 {
		var n int64
		require.NoError(t, db.Pool.QueryRow(ctx, "SELECT next_offset FROM processed_event_progress WHERE consumer_group = 'g' AND topic = $1", topic).Scan(&n))
		return n
	}
	// consume runs a subscriber and the middleware until want events are
	// claimed, and returns the middleware's stats.
	consume := func(want int) idem.Stats {
		d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table}, nil)
		require.NoError(t, err)
		sc, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, "g")
		require.NoError(t, err)
		sub, err := kafka.NewSubscriber(sc, watermill.NopLogger{})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddConsumerHandler("progress-txn", topic, sub, func(*message.Message) error { return nil }).AddMiddleware(d.Middleware)
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- router.Run(rctx) }()
		deadline := time.Now().Add(time.Minute)
		for db.Count(t, "SELECT 1 FROM processed_event") < want {
			require.True(t, time.Now().Before(deadline), "timed out waiting for %d claims", want)
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, sub.Close())
		return d.Stats()
	}

	send(4) // offsets 0-2 and marker 3, 4-6 and 7, …
	st := consume(12)
	require.Zero(t, st.KafkaAhead, "a commit marker is not a gap")
	require.EqualValues(t, 15, position(), "after the fourth transaction's last record (14)")

	send(4) // the committed offset, 15, is the fourth commit marker: the first record read is 16
	st = consume(24)
	require.Zero(t, st.KafkaAhead, "started at PostgreSQL's position: nothing ahead")
	require.EqualValues(t, 31, position(), "the position still follows the records")
}
