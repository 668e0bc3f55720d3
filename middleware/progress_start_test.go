package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// A subscriber assigned partitions that hold no record yet (a retry
// topic's, before its first copy) writes where each starts as its
// position in PostgreSQL, before any record: watermill-kafka's through the
// middleware, for a Kafka group named in Config.KafkaGroups, and the
// parallel subscriber with Progress. A failover after the cut then still
// finds those partitions' positions (tests/failover
// TestFailoverWithRetryTopics_*). A Kafka group the middleware does not
// name gets none, nor does one of a middleware in lease mode, which keeps
// no position yet.
func TestProgressStartsAtAssignment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "start", 3)
	client := idemkafka.ClientConfig{Brokers: broker.Addrs}
	positions := func(group string) int {
		return db.Count(t, "SELECT 1 FROM "+db.Schema+".processed_event_progress WHERE consumer_group = $1 AND topic = $2 AND next_offset = 0", group, topic)
	}
	subscribe := func(sub message.Subscriber) {
		_, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
	}

	_, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table, KafkaGroups: []string{"g-retry"}}, nil)
	require.NoError(t, err)
	_, err = idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "l", Table: table, KafkaGroups: []string{"l-retry"}, Mode: &idem.LeaseConfig{}}, nil)
	require.NoError(t, err)
	for _, kg := range []string{"g-retry", "unnamed", "l-retry"} {
		cfg, err := idemkafka.WatermillSubscriberConfig(client, kg)
		require.NoError(t, err)
		sub, err := kafka.NewSubscriber(cfg, nil)
		require.NoError(t, err)
		subscribe(sub)
	}
	par, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: client, ConsumerGroup: "p", Progress: db.Pool, ProgressSchema: db.Schema}, nil)
	require.NoError(t, err)
	subscribe(par)

	require.Eventually(t, func() bool { return positions("g") == 3 && positions("p") == 3 }, time.Minute, 50*time.Millisecond,
		"positions at 0 of the middleware's group (written for g-retry's claims), and of the parallel subscriber")
	require.Zero(t, db.Count(t, "SELECT 1 FROM "+db.Schema+".processed_event_progress WHERE consumer_group <> ALL('{g,p}')"), "the unnamed group's claims, and those of a lease-mode middleware's group (which records no position yet), write nothing")
}
