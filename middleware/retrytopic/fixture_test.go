package retrytopic_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// fixture is one test's schema (processed_event, the parked-keys table and
// a ledger), broker topics (main, retry, poison) and a Kafka publisher.
type fixture struct {
	db     *pgtest.DB
	broker *kafkatest.Broker
	main   string
	retry  string
	poison string
	// group is the dedup consumer group and the main topic's Kafka group.
	group string
	pub   message.Publisher
	// ob is the outbox of the retry topic (KeyOrder's hand-offs); its
	// forwarder runs once keyOrder was called.
	ob      *outbox.Outbox
	fwdOnce sync.Once
	// sqlDB, when set, is the database of the middleware and KeyOrder (a
	// *sql.DB through idem.SQLDB), and the ledger handler writes through
	// the *sql.Tx (idem.CompleteSQL).
	sqlDB migrate.Beginner
}

// dbOrSQL is the middleware's and KeyOrder's database.
func (f *fixture) dbOrSQL() migrate.Beginner {
	if f.sqlDB != nil {
		return f.sqlDB
	}
	return f.db.Pool
}

func newFixture(t *testing.T, mainPartitions, retryPartitions int32) *fixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 16)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	require.NoError(t, migrate.Up(ctx, db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema})))
	db.Exec(t, `CREATE TABLE ledger (
		seq      bigserial PRIMARY KEY,
		event_id uuid NOT NULL,
		key      text NOT NULL,
		n        int  NOT NULL
	)`)
	broker := kafkatest.Start(t)
	f := &fixture{db: db, broker: broker}
	f.main = broker.Topic(t, "orders", mainPartitions)
	f.retry = broker.Topic(t, "orders-retry", retryPartitions)
	f.poison = broker.Topic(t, "orders-poison", 1)
	f.group = f.main + "-ledger"

	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	f.pub = pub
	f.ob, err = outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{f.retry}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(f.ob.Config(), f.retry)))
	return f
}

// forwardPollInterval is the test forwarders' wait after an empty read: a
// hand-off waits for it at most.
const forwardPollInterval = 5 * time.Millisecond

// forward runs a forwarder of the fixture's outbox until the test ends.
func (f *fixture) forward(t *testing.T) {
	t.Helper()
	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: f.broker.Addrs})
	require.NoError(t, err)
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: f.db.Pool, Outbox: f.ob, Producer: producer, PollInterval: forwardPollInterval}, nil)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = fwd.Run(context.Background())
	}()
	t.Cleanup(func() {
		_ = fwd.Close()
		<-done
		_ = producer.Close()
	})
}

// event is the payload of the test's events.
type event struct {
	Key string `json:"key"`
	N   int    `json:"n"`
}

// msg returns an event message of key with a new UUIDv7 event id.
func (f *fixture) msg(key string, n int) *message.Message {
	payload, _ := json.Marshal(event{Key: key, N: n})
	m := message.NewMessage(uuid.NewString(), payload)
	m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	publisher.WithPartitionKey(m, key)
	return m
}

func (f *fixture) publish(t *testing.T, msgs ...*message.Message) {
	t.Helper()
	require.NoError(t, f.pub.Publish(f.main, msgs...))
}

func (f *fixture) retryConfig(mod func(*retrytopic.Config)) retrytopic.Config {
	cfg := retrytopic.Config{
		Publisher:   f.pub,
		Topics:      []string{f.retry},
		PoisonTopic: f.poison,
		MaxAttempts: 3,
		Backoff:     retrytopic.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	}
	if mod != nil {
		mod(&cfg)
	}
	return cfg
}

// keyOrder is a KeyOrder on the fixture's schema, its hand-offs forwarded
// to the retry topic.
func (f *fixture) keyOrder(t *testing.T) *retrytopic.KeyOrder {
	f.fwdOnce.Do(func() { f.forward(t) })
	return &retrytopic.KeyOrder{DB: f.dbOrSQL(), Outbox: f.ob, ConsumerGroup: f.group, Table: retrytopic.ParkedKeysTable{Schema: f.db.Schema}}
}

// failFunc decides whether the ledger handler fails for an event (after
// writing its row, which the rollback removes). onRetry: the message came
// from a retry topic.
type failFunc func(ev event, onRetry bool) error

type consumer struct {
	rt    *retrytopic.RetryTopic
	dedup *idem.Dedup
	// holdInHandler: the retry subscriber is a plain one, so only the
	// middleware's own wait holds the copies.
	holdInHandler bool
	// retryTopics to consume, default the fixture's one.
	retryTopics []string
	// sarama is the base client config of the subscribers (nil: default).
	sarama *sarama.Config
	// observe, when set, goes outside rt.Middleware.
	observe message.HandlerMiddleware
	// parallel, when positive, consumes every topic with an
	// parallel.Subscriber of that MaxInFlight (OrderKey; the retry topics'
	// with NotBeforeFunc retrytopic.RecordNotBefore) instead of
	// watermill-kafka's.
	parallel int
}

// run starts one router with the main handler and a retry handler per retry
// topic, the documented chain around them: rt.Middleware, watermill's Retry
// (one in-process retry, permanent errors not retried), the dedup
// middleware, rt.ReleaseMiddleware. It returns when the router runs; the
// router is closed when the test ends.
func (f *fixture) run(t *testing.T, c consumer, fail failFunc) *message.Router {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logger := watermill.NopLogger{}
	var sub, retrySub message.Subscriber
	if c.parallel > 0 {
		sub, retrySub = f.parallelSubscribers(t, c)
	} else {
		kc := idemkafka.ClientConfig{Brokers: f.broker.Addrs, Sarama: c.sarama}
		subCfg, err := idemkafka.WatermillSubscriberConfig(kc, f.group)
		require.NoError(t, err)
		ks, err := kafka.NewSubscriber(subCfg, logger)
		require.NoError(t, err)
		sub = ks
		var retryCfg kafka.SubscriberConfig
		retryCfg, err = idemkafka.WatermillSubscriberConfig(kc, f.group+"-retry")
		require.NoError(t, err)
		if !c.holdInHandler {
			retryCfg.Tracer = retrytopic.HoldingTracer(retryCfg.Tracer)
		}
		rs, err := kafka.NewSubscriber(retryCfg, logger)
		require.NoError(t, err)
		retrySub = rs
	}

	retry := wmiddleware.Retry{
		MaxRetries:      1,
		InitialInterval: time.Millisecond,
		ShouldRetry:     func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) },
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	require.NoError(t, err)
	if c.observe != nil {
		router.AddMiddleware(c.observe)
	}
	router.AddMiddleware(c.rt.Middleware, retry.Middleware, c.dedup.Middleware, c.rt.ReleaseMiddleware)
	h := f.ledgerHandler(fail)
	router.AddConsumerHandler("ledger", f.main, sub, h)
	topics := c.retryTopics
	if topics == nil {
		topics = []string{f.retry}
	}
	for _, tp := range topics {
		router.AddConsumerHandler("ledger-retry-"+tp, tp, retrySub, h)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(ctx)
	}()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		cancel()
		<-done
		_ = sub.Close()
		_ = retrySub.Close()
	})
	<-router.Running()
	return router
}

// parallelSubscribers are the main and retry subscribers of c as
// parallel.Subscribers: key order, c.parallel messages in flight each; the
// retry one holds each copy in its partition's window until its not-before
// time (retrytopic.RecordNotBefore).
func (f *fixture) parallelSubscribers(t *testing.T, c consumer) (sub, retrySub message.Subscriber) {
	t.Helper()
	cfg := parallel.SubscriberConfig{
		Client:          idemkafka.ClientConfig{Brokers: f.broker.Addrs, Sarama: c.sarama, RevokeTimeout: 5 * time.Second},
		ConsumerGroup:   f.group,
		MaxInFlight:     c.parallel,
		NackResendSleep: 10 * time.Millisecond,
	}
	s, err := parallel.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	cfg.ConsumerGroup = f.group + "-retry"
	if !c.holdInHandler {
		cfg.NotBeforeFunc = retrytopic.RecordNotBefore
	}
	rs, err := parallel.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	return s, rs
}

// ledgerHandler writes (event_id, key, n) to the ledger in the message's
// transaction (through idem.Complete: in lease mode, the completing one),
// then asks fail.
func (f *fixture) ledgerHandler(fail failFunc) message.NoPublishHandlerFunc {
	return func(m *message.Message) error {
		var ev event
		if err := json.Unmarshal(m.Payload, &ev); err != nil {
			return idem.Permanent(err)
		}
		if err := f.complete(m.Context(), ev); err != nil {
			return err
		}
		if fail != nil {
			onRetry := m.Metadata.Get(retrytopic.MetadataAttempt) != ""
			return fail(ev, onRetry)
		}
		return nil
	}
}

// complete writes ev's ledger row with idem.Complete (pgx), or with
// idem.CompleteSQL on a *sql.DB.
func (f *fixture) complete(ctx context.Context, ev event) error {
	const insert = "INSERT INTO ledger (event_id, key, n) VALUES ($1, $2, $3)"
	if f.sqlDB != nil {
		return idem.CompleteSQL(ctx, func(ctx context.Context, tx *sql.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := tx.ExecContext(ctx, insert, id.String(), ev.Key, ev.N)
			return err
		})
	}
	return idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
		id, _ := idem.EventIDFromContext(ctx)
		_, err := tx.Exec(ctx, insert, id, ev.Key, ev.N)
		return err
	})
}

func (f *fixture) newDedup(t *testing.T) *idem.Dedup {
	t.Helper()
	d, err := idem.NewDedup(idem.Config{DB: f.dbOrSQL(), ConsumerGroup: f.group, Table: deduplicator.TableConfig{Schema: f.db.Schema}}, nil)
	require.NoError(t, err)
	return d
}

// newLeaseDedup is newDedup in lease mode.
func (f *fixture) newLeaseDedup(t *testing.T) *idem.Dedup {
	t.Helper()
	d, err := idem.NewDedup(idem.Config{DB: f.dbOrSQL(), ConsumerGroup: f.group, Table: deduplicator.TableConfig{Schema: f.db.Schema},
		Mode: &idem.LeaseConfig{Concurrency: 1}}, nil)
	require.NoError(t, err)
	return d
}

// rows returns the number of ledger rows.
func (f *fixture) rows(t *testing.T, where string, args ...any) int {
	t.Helper()
	q := "SELECT 1 FROM ledger"
	if where != "" {
		q += " WHERE " + where
	}
	return f.db.Count(t, q, args...)
}

// order returns the n of key's ledger rows, in the order they were applied.
func (f *fixture) order(t *testing.T, key string) []int {
	t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), "SELECT n FROM ledger WHERE key = $1 ORDER BY seq", key)
	require.NoError(t, err)
	defer rows.Close()
	var out []int
	for rows.Next() {
		var n int
		require.NoError(t, rows.Scan(&n))
		out = append(out, n)
	}
	require.NoError(t, rows.Err())
	return out
}

// eachAppliedOnce fails unless every event id in the ledger appears once
// and the ledger has want rows.
func (f *fixture) eachAppliedOnce(t *testing.T, want int) {
	t.Helper()
	require.Equal(t, want, f.rows(t, ""))
	require.Equal(t, want, f.db.Count(t, "SELECT DISTINCT event_id FROM ledger"), "an event applied twice")
	require.Equal(t, want, f.db.Count(t, "SELECT 1 FROM processed_event"))
}

// collector reads a topic (the poison topic) in a consumer group of its own.
type collector struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (f *fixture) collect(t *testing.T, topic string) *collector {
	t.Helper()
	cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: f.broker.Addrs}, topic+"-reader")
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	c := &collector{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range ch {
			c.mu.Lock()
			c.msgs = append(c.msgs, m)
			c.mu.Unlock()
			m.Ack()
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		<-done
	})
	return c
}

func (c *collector) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

// byEventID returns the collected messages by event_id.
func (c *collector) byEventID() map[string]*message.Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]*message.Message{}
	for _, m := range c.msgs {
		out[m.Metadata.Get(publisher.MetadataEventID)] = m
	}
	return out
}

func eventually(t *testing.T, cond func() bool, what string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, 90*time.Second, 20*time.Millisecond, fmt.Sprintf(what, args...))
}
