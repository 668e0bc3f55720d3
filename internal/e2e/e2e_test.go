package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

const (
	events     = 1000
	duplicates = 300
	partitions = 4
)

type orderPaid struct {
	Amount int64 `json:"amount"`
}

// consumer is one service instance: its own pool, subscriber, dedup
// middleware and router, in the shared consumer group.
type consumer struct {
	router *message.Router
	calls  atomic.Int32 // handler invocations (committed or not)
}

// 1,000 events plus 300 re-published duplicates (same event_id, new
// message, new offset) on a 4-partition topic, consumed by two routers in
// one consumer group; the second joins half way, forcing a rebalance. The
// ledger ends with exactly one row per event and the right sum.
func TestKafkaToPostgresExactlyOnceAcrossRebalance(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, deduplicator.Migrate(ctx, db.Pool, table))
	db.Exec(t, "CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, amount bigint NOT NULL)")

	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "payments", partitions)
	group := topic + "-ledger"
	logger := watermill.NopLogger{}

	pubCfg, err := publisher.NewKafkaPublisherConfig(publisher.KafkaConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	// The events, and the order they are published in: phase 1 has events
	// 0..499 with 100 duplicates of them, phase 2 events 500..999 with 100
	// duplicates of phase-2 events and 100 more of phase-1 events.
	var wantSum int64
	originals := make([]*message.Message, events)
	for i := range events {
		m := message.NewMessage(uuid.NewString(), mustJSON(t, orderPaid{Amount: int64(i + 1)}))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		m.Metadata.Set(publisher.MetadataPartitionKey, fmt.Sprintf("account-%d", i%37))
		originals[i] = m
		wantSum += int64(i + 1)
	}
	redelivery := func(i int) *message.Message {
		m := originals[i].Copy()
		m.UUID = uuid.NewString() // a new message (and a new offset), the same event
		return m
	}
	var phase1, phase2 []*message.Message
	for i := range events / 2 {
		phase1 = append(phase1, originals[i])
		if i%5 == 0 {
			phase1 = append(phase1, redelivery(i))
		}
	}
	for i := events / 2; i < events; i++ {
		phase2 = append(phase2, originals[i])
		switch i % 5 {
		case 0:
			phase2 = append(phase2, redelivery(i))
		case 1:
			phase2 = append(phase2, redelivery(i-events/2))
		}
	}
	require.Len(t, append(phase1, phase2...), events+duplicates)

	var ackedMu sync.Mutex
	acked := map[string]bool{} // message UUIDs the dedup layer acked
	ackedCount := func() int {
		ackedMu.Lock()
		defer ackedMu.Unlock()
		return len(acked)
	}
	start := func(name string) *consumer {
		c := &consumer{}
		cfg, err := pgxpool.ParseConfig(db.URL)
		require.NoError(t, err)
		cfg.MaxConns = 4
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)

		subCfg, err := publisher.NewKafkaSubscriberConfig(publisher.KafkaConfig{Brokers: broker.Addrs}, group)
		require.NoError(t, err)
		sub, err := kafka.NewSubscriber(subCfg, logger)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })

		dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: group, Table: table}, logger)
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, logger)
		require.NoError(t, err)
		countAcks := func(h message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) {
				out, err := h(m)
				if err == nil {
					ackedMu.Lock()
					acked[m.UUID] = true
					ackedMu.Unlock()
				}
				return out, err
			}
		}
		retry := wmiddleware.Retry{MaxRetries: 5, InitialInterval: 20 * time.Millisecond,
			ShouldRetry: func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
		router.AddMiddleware(countAcks, retry.Middleware, dedup.Middleware)
		router.AddConsumerHandler("ledger-"+name, topic, sub, func(m *message.Message) error {
			c.calls.Add(1)
			var e orderPaid
			if err := json.Unmarshal(m.Payload, &e); err != nil {
				return idem.Permanent(err)
			}
			ctx := m.Context()
			id, _ := idem.EventIDFromContext(ctx)
			_, err := idem.MustTxFromContext(ctx).Exec(ctx, "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)", id, e.Amount)
			return err
		})
		c.router = router
		go func() { _ = router.Run(ctx) }()
		t.Cleanup(func() { _ = router.Close() })
		<-router.Running()
		return c
	}

	require.NoError(t, pub.Publish(topic, phase1...))
	first := start("a")
	require.Eventually(t, func() bool { return db.Count(t, "SELECT 1 FROM ledger") >= 200 },
		60*time.Second, 20*time.Millisecond, "the first router consumes")

	second := start("b")
	// The rebalance: wait until the group has both members, each owning
	// partitions of the topic (works the same on kfake and real Kafka).
	require.Eventually(t, func() bool { return bothMembersAssigned(t, broker.Addrs, group, topic) },
		60*time.Second, 50*time.Millisecond, "both routers own partitions after the rebalance")
	require.NoError(t, pub.Publish(topic, phase2...))

	require.Eventually(t, func() bool { return ackedCount() == events+duplicates },
		90*time.Second, 50*time.Millisecond, "every published message is acked")
	require.NoError(t, first.router.Close())
	require.NoError(t, second.router.Close())

	require.Equal(t, events, db.Count(t, "SELECT 1 FROM ledger"), "one ledger row per event")
	require.Equal(t, events, db.Count(t, "SELECT DISTINCT event_id FROM ledger"))
	var sum int64
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT sum(amount) FROM ledger").Scan(&sum))
	require.Equal(t, wantSum, sum)
	require.Equal(t, events, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = $1", group))
	require.Positive(t, first.calls.Load())
	require.Positive(t, second.calls.Load(), "the second router processed events after the rebalance")
	t.Logf("handler calls: a=%d b=%d (ledger rows %d)", first.calls.Load(), second.calls.Load(), events)
}

// bothMembersAssigned reports whether group has two members that each own at
// least one partition of topic.
func bothMembersAssigned(t *testing.T, brokers []string, group, topic string) bool {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return false
	}
	defer admin.Close()
	groups, err := admin.DescribeConsumerGroups([]string{group})
	if err != nil || len(groups) != 1 || groups[0].State != "Stable" || len(groups[0].Members) != 2 {
		return false
	}
	for _, m := range groups[0].Members {
		a, err := m.GetMemberAssignment()
		if err != nil || a == nil || len(a.Topics[topic]) == 0 {
			return false
		}
	}
	return true
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
