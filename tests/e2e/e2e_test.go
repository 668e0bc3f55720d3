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
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
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

// env is one test's PostgreSQL schema (processed_event + ledger), broker and
// Kafka publisher.
type env struct {
	db     *pgtest.DB
	table  deduplicator.TableConfig
	broker *kafkatest.Broker
	pub    *kafka.Publisher
	logger watermill.LoggerAdapter
}

func newEnv(ctx context.Context, t *testing.T) *env {
	t.Helper()
	e := &env{db: pgtest.New(t, 4), broker: kafkatest.Start(t), logger: watermill.NopLogger{}}
	e.table = deduplicator.TableConfig{Schema: e.db.Schema}
	require.NoError(t, migrate.Up(ctx, e.db.Pool, deduplicator.MigrationLine(e.table)))
	e.db.Exec(t, "CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, amount bigint NOT NULL)")
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: e.broker.Addrs})
	require.NoError(t, err)
	e.pub, err = kafka.NewPublisher(pubCfg, e.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.pub.Close() })
	return e
}

// subscriber joins group (the safe consumer config).
func (e *env) subscriber(t *testing.T, group string) *kafka.Subscriber {
	t.Helper()
	cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: e.broker.Addrs}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(cfg, e.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// run starts a router with the middlewares and the ledger handler on topic;
// it is closed when the test ends.
func (e *env) run(ctx context.Context, t *testing.T, name, topic string, sub message.Subscriber, calls *atomic.Int32, mws ...message.HandlerMiddleware) *message.Router {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, e.logger)
	require.NoError(t, err)
	router.AddMiddleware(mws...)
	router.AddConsumerHandler(name, topic, sub, ledgerHandler(calls))
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()
	return router
}

// ledgerHandler inserts the event's amount into ledger in the middleware's
// transaction (through idem.Complete: at once in transaction mode, in the
// completing transaction in lease mode) and counts its calls.
func ledgerHandler(calls *atomic.Int32) message.NoPublishHandlerFunc {
	return func(m *message.Message) error {
		calls.Add(1)
		var e orderPaid
		if err := json.Unmarshal(m.Payload, &e); err != nil {
			return idem.Permanent(err)
		}
		return idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)", id, e.Amount)
			return err
		})
	}
}

// acks records the messages acked by the handler chain inside it.
type acks struct {
	mu         sync.Mutex
	uuids      map[string]bool
	deliveries atomic.Int32 // redeliveries included
}

func newAcks() *acks { return &acks{uuids: map[string]bool{}} }

func (a *acks) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		out, err := h(m)
		if err == nil {
			a.deliveries.Add(1)
			a.mu.Lock()
			a.uuids[m.UUID] = true
			a.mu.Unlock()
		}
		return out, err
	}
}

func (a *acks) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.uuids)
}

func (a *acks) has(uuids ...string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, u := range uuids {
		if !a.uuids[u] {
			return false
		}
	}
	return true
}

// 1,000 events plus 300 re-published duplicates (same event_id, new
// message, new offset) on a 4-partition topic, consumed by two routers in
// one consumer group; the second joins half way, forcing a rebalance. The
// ledger ends with exactly one row per event and the right sum.
func TestKafkaToPostgresExactlyOnceAcrossRebalance(t *testing.T) {
	t.Parallel()
	exactlyOnceAcrossRebalance(t, false)
}

// The same in lease mode, on the parallel subscriber: its handlers hold no
// transaction, so 64 messages in flight share a pool of 4 connections.
func TestKafkaToPostgresExactlyOnceAcrossRebalance_LeaseMode(t *testing.T) {
	t.Parallel()
	exactlyOnceAcrossRebalance(t, true)
}

func exactlyOnceAcrossRebalance(t *testing.T, lease bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e := newEnv(ctx, t)
	topic := e.broker.Topic(t, "payments", partitions)
	group := topic + "-ledger"

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

	// One service instance: its own pool, subscriber, dedup middleware and
	// router, in the shared consumer group.
	acked := newAcks()
	start := func(name string, calls *atomic.Int32) *message.Router {
		pcfg, err := pgxpool.ParseConfig(e.db.URL)
		require.NoError(t, err)
		pcfg.MaxConns = 4
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		cfg := idem.Config{DB: pool, ConsumerGroup: group, Table: e.table}
		var sub message.Subscriber = e.subscriber(t, group)
		if lease {
			cfg.Mode = &idem.LeaseConfig{Concurrency: 1}
			psub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: e.broker.Addrs}, ConsumerGroup: group, MaxInFlight: 64}, e.logger)
			require.NoError(t, err)
			t.Cleanup(func() { _ = psub.Close() })
			sub, cfg.Concurrency = psub, psub.MaxInFlight()
		}
		dedup, err := idem.NewDedup(cfg, e.logger)
		require.NoError(t, err)
		retry := wmiddleware.Retry{MaxRetries: 5, InitialInterval: 20 * time.Millisecond,
			ShouldRetry: func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
		return e.run(ctx, t, "ledger-"+name, topic, sub, calls, acked.middleware, retry.Middleware, dedup.Middleware)
	}

	var callsA, callsB atomic.Int32 // handler invocations (committed or not)
	require.NoError(t, e.pub.Publish(topic, phase1...))
	first := start("a", &callsA)
	require.Eventually(t, func() bool { return e.db.Count(t, "SELECT 1 FROM ledger") >= 200 },
		60*time.Second, 20*time.Millisecond, "the first router consumes")

	second := start("b", &callsB)
	// The first half of phase 2 is produced while the group rebalances; the
	// second half once both routers own partitions (works the same on kfake
	// and real Kafka), so the second router certainly gets events.
	during := make(chan error, 1)
	go func() { during <- e.pub.Publish(topic, phase2[:len(phase2)/2]...) }()
	require.Eventually(t, func() bool { return bothMembersAssigned(t, e.broker.Addrs, group, topic) },
		60*time.Second, 50*time.Millisecond, "both routers own partitions after the rebalance")
	require.NoError(t, <-during)
	require.NoError(t, e.pub.Publish(topic, phase2[len(phase2)/2:]...))

	require.Eventually(t, func() bool { return acked.count() == events+duplicates },
		90*time.Second, 50*time.Millisecond, "every published message is acked")
	require.NoError(t, first.Close())
	require.NoError(t, second.Close())

	require.Equal(t, events, e.db.Count(t, "SELECT 1 FROM ledger"), "one ledger row per event")
	require.Equal(t, events, e.db.Count(t, "SELECT DISTINCT event_id FROM ledger"))
	var sum int64
	require.NoError(t, e.db.Pool.QueryRow(ctx, "SELECT sum(amount) FROM ledger").Scan(&sum))
	require.Equal(t, wantSum, sum)
	require.Equal(t, events, e.db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = $1", group))
	require.Zero(t, e.db.Count(t, "SELECT 1 FROM processed_event_lease"), "every lease completed")
	require.Positive(t, callsA.Load())
	require.Positive(t, callsB.Load(), "the second router processed events after the rebalance")
	n := int(acked.deliveries.Load())
	t.Logf("handler calls: a=%d b=%d; acked deliveries %d for %d messages (%d redelivered by the rebalance); ledger rows %d",
		callsA.Load(), callsB.Load(), n, events+duplicates, n-(events+duplicates), events)
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

// Crash after COMMIT, before the offset commit, through the real Kafka path:
// consumer A commits event 1 and "dies" before acking it (its subscriber is
// closed while the ack is withheld); consumer B in the same group gets event
// 1 again from the last committed offset, skips it, and applies event 2.
func TestCrashAfterCommitBeforeAckOverKafka(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := newEnv(ctx, t)
	topic := e.broker.Topic(t, "crash", 1)
	group := topic + "-ledger"

	var msgs []*message.Message
	for i := range 3 {
		m := message.NewMessage(uuid.NewString(), mustJSON(t, orderPaid{Amount: int64(10 * (i + 1))}))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		msgs = append(msgs, m)
	}
	require.NoError(t, e.pub.Publish(topic, msgs...))
	crashOn := msgs[1].Metadata.Get(publisher.MetadataEventID)
	dedup, err := idem.NewDedup(idem.Config{DB: e.db.Pool, ConsumerGroup: group, Table: e.table}, e.logger)
	require.NoError(t, err)

	// Consumer A: after the middleware committed event 1, the process "dies":
	// the handler chain never returns, so the message is never acked.
	committed := make(chan struct{})
	dead := make(chan struct{})
	crashAfterCommit := func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err == nil && m.Metadata.Get(publisher.MetadataEventID) == crashOn {
				close(committed)
				<-dead
			}
			return out, err
		}
	}
	var callsA, callsB atomic.Int32
	subA := e.subscriber(t, group)
	e.run(ctx, t, "ledger-a", topic, subA, &callsA, crashAfterCommit, dedup.Middleware)
	t.Cleanup(func() { close(dead) }) // runs before the router's Close: let the stuck handler return
	select {
	case <-committed:
	case <-ctx.Done():
		t.Fatal("consumer A never committed event 1")
	}
	require.Equal(t, 2, e.db.Count(t, "SELECT 1 FROM ledger"), "events 0 and 1 committed")
	require.NoError(t, subA.Close()) // the crash: A leaves the group without acking event 1

	// Consumer B takes over the partition.
	acked := newAcks()
	routerB := e.run(ctx, t, "ledger-b", topic, e.subscriber(t, group), &callsB, acked.middleware, dedup.Middleware)
	require.Eventually(t, func() bool { return acked.has(msgs[1].UUID, msgs[2].UUID) },
		60*time.Second, 20*time.Millisecond, "B receives event 1 again and event 2")
	require.NoError(t, routerB.Close())

	require.EqualValues(t, 2, callsA.Load())
	require.EqualValues(t, 1, callsB.Load(), "B ran the handler for event 2 only: event 1 was a duplicate")
	require.Equal(t, 3, e.db.Count(t, "SELECT 1 FROM ledger"))
	require.Equal(t, 3, e.db.Count(t, "SELECT DISTINCT event_id FROM ledger"))
	require.Equal(t, 3, e.db.Count(t, "SELECT 1 FROM processed_event"))
}
