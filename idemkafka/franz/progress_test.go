package franz_test

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Every assignment starts a partition from PostgreSQL's position, which
// wins over Kafka's committed offset, and the member writes its position
// there: at the first join (a position behind Kafka's, as a failover to an
// asynchronous standby leaves it), and when a second member gains a
// partition mid-run (cooperative-sticky's incremental rebalance, KIP-848's
// broker-side assignment). A partition without a row starts from Kafka's
// committed offset.
func TestSubscriberStartsFromPostgreSQLsPosition(t *testing.T) {
	t.Parallel()
	for _, protocol := range []string{"classic", "consumer"} {
		t.Run(protocol, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := kafkatest.Start(t)
			db := pgtest.New(t, 4)
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
			table := progresssql.Table(db.Schema, "processed_event")
			topic := b.Topic(t, "progress", 2)
			group := "progress-" + protocol
			produceTo(t, b.Addrs, topic, 10)
			commitKafka(t, b.Addrs, group, topic, 8)
			setPosition := func(partition int32, next int64) {
				_, err := db.Pool.Exec(ctx, "INSERT INTO "+table+" (consumer_group, topic, kafka_partition, next_offset) VALUES ($1, $2, $3, $4) "+
					"ON CONFLICT (consumer_group, topic, kafka_partition) DO UPDATE SET next_offset = EXCLUDED.next_offset", group, topic, partition, next)
				require.NoError(t, err)
			}
			position := func(partition int32) (next int64) {
				require.NoError(t, db.Pool.QueryRow(ctx, "SELECT coalesce(max(next_offset), -1) FROM "+table+
					" WHERE consumer_group = $1 AND topic = $2 AND kafka_partition = $3", group, topic, partition).Scan(&next))
				return next
			}
			setPosition(0, 3) // behind Kafka's 8; partition 1 has no row

			cfg := franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: group, GroupProtocol: protocol,
				Progress: db.Pool, ProgressSchema: db.Schema, CommitInterval: 50 * time.Millisecond}
			first := member(t, cfg, topic)
			require.Eventually(t, func() bool { return position(0) == 10 && position(1) == 10 }, 30*time.Second, 20*time.Millisecond,
				"the member writes its position")
			require.Equal(t, map[int32]int64{0: 3, 1: 8}, first.starts(), "partition 0 from PostgreSQL's position, 1 from Kafka's")

			// Both positions go back; the member that stays writes nothing
			// (its position did not move), the one that joins starts the
			// partition it gains from PostgreSQL's 5, not Kafka's 10.
			setPosition(0, 5)
			setPosition(1, 5)
			second := member(t, cfg, topic)
			require.Eventually(t, func() bool { return len(second.starts()) == 1 }, 30*time.Second, 20*time.Millisecond, "the second member gains a partition")
			for part, start := range second.starts() {
				require.Equal(t, int64(5), start, "partition %d", part)
				require.Eventually(t, func() bool { return position(part) == 10 }, 30*time.Second, 20*time.Millisecond)
			}
		})
	}
}

// consumed is what a test member was handed: each partition's first offset.
type consumed struct {
	mu    sync.Mutex
	first map[int32]int64
}

func (c *consumed) starts() map[int32]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.first)
}

// member subscribes a Subscriber of cfg to topic, acks every message, and
// records where each partition started.
func member(t *testing.T, cfg franz.SubscriberConfig, topic string) *consumed {
	sub, err := franz.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	c := &consumed{first: map[int32]int64{}}
	go func() {
		for msg := range ch {
			part, _ := kafka.MessagePartitionFromCtx(msg.Context())
			off, _ := kafka.MessagePartitionOffsetFromCtx(msg.Context())
			c.mu.Lock()
			if _, ok := c.first[part]; !ok {
				c.first[part] = off
			}
			c.mu.Unlock()
			msg.Ack()
		}
	}()
	return c
}

// produceTo writes n records to each of topic's two partitions.
func produceTo(t *testing.T, brokers []string, topic string, n int) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	for i := range 2 * n {
		r := &kgo.Record{Topic: topic, Partition: int32(i % 2), Value: []byte("v"),
			Headers: []kgo.RecordHeader{{Key: kafka.UUIDHeaderKey, Value: []byte("id")}}}
		require.NoError(t, cl.ProduceSync(context.Background(), r).FirstErr())
	}
}

// commitKafka commits offset for both partitions of topic in group, as a
// group with no member can be committed to (by name: a request older than
// topic ids).
func commitKafka(t *testing.T, brokers []string, group, topic string, offset int64) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.MaxVersions(kversion.V3_9_0()))
	require.NoError(t, err)
	defer cl.Close()
	req := kmsg.NewPtrOffsetCommitRequest()
	req.Group, req.Generation = group, -1
	rt := kmsg.NewOffsetCommitRequestTopic()
	rt.Topic = topic
	for p := range int32(2) {
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition, rp.Offset = p, offset
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(context.Background(), cl)
	require.NoError(t, err)
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			require.NoError(t, kerr.ErrorForCode(rp.ErrorCode))
		}
	}
}

// A partition gained without a row in PostgreSQL gets its start written
// as its row at assignment, before any of its records is handed out: a
// partition with nothing new to read (a retry topic's, first used later)
// then has a position that a promoted standby holds too, where Kafka's
// committed offset would skip what comes after it.
func TestSubscriberRecordsAPartitionsStartAtAssignment(t *testing.T) {
	t.Parallel()
	for _, protocol := range []string{"classic", "consumer"} {
		t.Run(protocol, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := kafkatest.Start(t)
			db := pgtest.New(t, 4)
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
			table := progresssql.Table(db.Schema, "processed_event")
			topic := b.Topic(t, "start", 2)
			group := "start-" + protocol
			produceTo(t, b.Addrs, topic, 4)
			commitKafka(t, b.Addrs, group, topic, 4) // every record consumed: nothing to read
			member(t, franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: group, GroupProtocol: protocol,
				Progress: db.Pool, ProgressSchema: db.Schema, CommitInterval: 50 * time.Millisecond}, topic)
			require.Eventually(t, func() bool {
				return db.Count(t, "SELECT 1 FROM "+table+" WHERE consumer_group = $1 AND topic = $2 AND next_offset = 4", group, topic) == 2
			}, 30*time.Second, 20*time.Millisecond, "both partitions' starts recorded")
		})
	}
}
