package failover_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// TestFailoverToAsyncStandby_Forwarder: the outbox relay keeps running
// while the database's address moves to the promoted standby, whose new
// transactions reuse the transaction ids of the lost ones. Every row of
// the promoted database is forwarded: none is skipped. The rows of the
// lost transactions that were forwarded before the failover stay in Kafka
// (their events happened for Kafka's readers, not for the database): the
// test counts them.
func TestFailoverToAsyncStandby_Forwarder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgcluster.New(t)
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "outbox-failover", 2)
	primary := env.Primary("primary", "")
	ob, err := outbox.New(outbox.Config{Topics: []string{topic}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, primary.Conn(ctx), outbox.MigrationLine(ob.Config(), topic)))
	standby := primary.Standby("standby")
	addr := env.Proxy(primary)
	pool, err := pgxpool.New(ctx, addr.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	t.Cleanup(func() { _ = producer.Close() })
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: pool, Outbox: ob, Producer: producer,
		PollInterval: 50 * time.Millisecond, RetryInterval: 100 * time.Millisecond}, watermill.NewStdLogger(false, false))
	require.NoError(t, err)
	runErr := make(chan error, 1)
	go func() { runErr <- fwd.Run(ctx) }()
	t.Cleanup(func() { _ = fwd.Close() })

	pub := ob.PoolPublisher(pool)
	write := func(n int) []string {
		var ids []string
		for i := range n {
			m := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte("{}")), "k"+string(rune('a'+i%4)))
			require.Eventually(t, func() bool { return pub.Publish(topic, m) == nil }, time.Minute, 100*time.Millisecond)
			ids = append(ids, m.Metadata.Get(publisher.MetadataEventID))
		}
		return ids
	}
	kept := write(perPhase / 2)
	waitForwarded(t, broker.Addrs, topic, kept)
	standby.CaughtUp(primary)

	standby.CutReplication()
	lost := write(perPhase / 2)
	waitForwarded(t, broker.Addrs, topic, lost)
	const xmax = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
	xmaxLost := count(t, primary, xmax)
	primary.StopImmediate()
	standby.Promote()
	addr.PointTo(standby)
	require.Less(t, count(t, standby, xmax), xmaxLost, "the promoted standby hands out transaction ids the lost transactions had used")
	require.Equal(t, len(kept), count(t, standby, "SELECT count(*) FROM "+ob.MessagesTable(topic)), "the promoted standby has the rows written before the cut only")

	after := write(perPhase / 2) // new transactions: the lost ones' transaction ids again
	waitForwarded(t, broker.Addrs, topic, append(kept, after...))
	select {
	case err := <-runErr:
		t.Fatalf("the forwarder stopped: %v", err)
	default:
	}
	t.Logf("every row of the promoted database was forwarded; %d events of lost transactions were forwarded before the failover", len(lost))
}

// waitForwarded waits until every event id of ids is on topic.
func waitForwarded(t *testing.T, brokers []string, topic string, ids []string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	var missing int
	for time.Now().Before(deadline) {
		seen := readEventIDs(t, brokers, topic)
		missing = 0
		for _, id := range ids {
			if !seen[id] {
				missing++
			}
		}
		if missing == 0 {
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
	t.Fatalf("%d of %d rows never forwarded", missing, len(ids))
}

// readEventIDs reads every record of topic and returns their event ids.
func readEventIDs(t *testing.T, brokers []string, topic string) map[string]bool {
	t.Helper()
	client, err := sarama.NewClient(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	require.NoError(t, err)
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, p := range parts {
		hw, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		if hw == 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		for m := range pc.Messages() {
			for _, h := range m.Headers {
				if string(h.Key) == publisher.MetadataEventID {
					seen[string(h.Value)] = true
				}
			}
			if m.Offset >= hw-1 {
				break
			}
		}
		_ = pc.Close()
	}
	return seen
}
