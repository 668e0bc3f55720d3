package outbox_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

const eventuallyTimeout = 60 * time.Second

type env struct {
	db     *pgtest.DB
	broker *kafkatest.Broker
	outbox *outbox.Outbox
}

// newEnv creates a schema, a broker and an Outbox whose tables (for topics)
// live in the test's schema.
func newEnv(t *testing.T, maxConns int32, topics ...string) *env {
	t.Helper()
	db := pgtest.New(t, maxConns)
	o, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: topics}, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, migrate.Up(context.Background(), db.Pool, lines(o.Config())...))
	return &env{db: db, outbox: o}
}

func (e *env) kafka(t *testing.T) *kafkatest.Broker {
	t.Helper()
	if e.broker == nil {
		e.broker = kafkatest.Start(t)
	}
	return e.broker
}

// topic creates a broker topic and its outbox tables.
func (e *env) topic(t *testing.T, prefix string, partitions int32) string {
	t.Helper()
	name := e.kafka(t).Topic(t, prefix, partitions)
	require.NoError(t, migrateTopics(context.Background(), e.db.Pool, e.outbox, name))
	return name
}

// migrateTopics migrates the tables of topics in o's schema, with o's
// prefix and payload type, whether or not o's Config lists them.
func migrateTopics(ctx context.Context, db migrate.Beginner, o *outbox.Outbox, topics ...string) error {
	cfg := o.Config()
	cfg.Topics = topics
	return migrate.Up(ctx, db, lines(cfg)...)
}

// lines are the migration lines of cfg's topics.
func lines(cfg outbox.Config) []migrate.Line {
	var out []migrate.Line
	for _, topic := range cfg.Topics {
		out = append(out, outbox.MigrationLine(cfg, topic))
	}
	return out
}

// newMigrator is a Migrator of cfg's topics.
func newMigrator(db migrate.Beginner, cfg outbox.Config) (*migrate.Migrator, error) {
	return migrate.New(db, lines(cfg)...)
}

// rendered is the SQL a Migrator renders for lines.
func rendered(ls ...migrate.Line) ([]migrate.Migration, error) {
	m, err := migrate.New(nil, ls...)
	if err != nil {
		return nil, err
	}
	return m.Migrations()
}

func (e *env) producer(t *testing.T) sarama.SyncProducer {
	t.Helper()
	p, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: e.kafka(t).Addrs})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// startForwarder runs a forwarder until the test ends.
func (e *env) startForwarder(t *testing.T, cfg outbox.ForwarderConfig) *outbox.Forwarder {
	t.Helper()
	return e.startForwarderLogged(t, cfg, watermill.NewStdLogger(os.Getenv("FWDLOG") != "", false))
}

// startForwarderLogged runs a forwarder logging to logger until the test
// ends; cfg.DB defaults to the test's pool.
func (e *env) startForwarderLogged(t *testing.T, cfg outbox.ForwarderConfig, logger watermill.LoggerAdapter) *outbox.Forwarder {
	t.Helper()
	if cfg.DB == nil {
		cfg.DB = e.db.Pool
	}
	cfg.Outbox = e.outbox
	if cfg.Producer == nil && cfg.Publisher == nil {
		cfg.Producer = e.producer(t)
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 10 * time.Millisecond
	}
	f, err := outbox.NewForwarder(cfg, logger)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, f.Close())
		require.NoError(t, <-done)
	})
	return f
}

// events builds n messages over keys aggregates: agg-0, agg-1, ... in
// turn, each key's sequence from 0.
func events(n, keys int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i%keys), i/keys)
	}
	return msgs
}

// event builds a message for aggregate key with sequence seq in its payload.
func event(key string, seq int) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"aggregate":%q,"seq":%d}`, key, seq)))
	return publisher.WithPartitionKey(msg, key)
}

// publishTx writes msgs to topic's outbox in one committed transaction.
func (e *env) publishTx(t *testing.T, topic string, msgs ...*message.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, e.outbox.Publisher(tx).Publish(topic, msgs...))
	require.NoError(t, tx.Commit(ctx))
}

// record is one consumed Kafka record.
type record struct {
	Partition int32
	Offset    int64
	Key       string
	Value     string
	Headers   map[string]string
}

// consume reads topic from the start on every partition until at least n
// records arrived (failing after eventuallyTimeout), and returns them in
// (partition, offset) order.
func consume(t *testing.T, brokers []string, topic string, n int) []record {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0
	c, err := sarama.NewConsumer(brokers, cfg)
	require.NoError(t, err)
	defer c.Close()
	parts, err := c.Partitions(topic)
	require.NoError(t, err)

	var mu sync.Mutex
	byPart := make(map[int32][]record)
	total := 0
	got := make(chan struct{})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, p := range parts {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer pc.Close()
			for {
				select {
				case <-stop:
					return
				case m := <-pc.Messages():
					r := record{Partition: m.Partition, Offset: m.Offset, Key: string(m.Key), Value: string(m.Value), Headers: map[string]string{}}
					for _, h := range m.Headers {
						r.Headers[string(h.Key)] = string(h.Value)
					}
					mu.Lock()
					byPart[p] = append(byPart[p], r)
					total++
					if total == n {
						close(got)
					}
					mu.Unlock()
				}
			}
		}()
	}
	select {
	case <-got:
	case <-time.After(eventuallyTimeout):
	}
	close(stop)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, total, n, "records on %s", topic)
	var out []record
	for _, p := range parts {
		out = append(out, byPart[p]...)
	}
	return out
}

// highWater returns the number of records in topic (sum of the partitions'
// newest offsets).
func highWater(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	parts, err := client.Partitions(topic)
	require.NoError(t, err)
	var n int64
	for _, p := range parts {
		off, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		n += off
	}
	return n
}

// waitPolls waits until f has completed at least k more polls than now.
func waitPolls(t *testing.T, f *outbox.Forwarder, k uint64) {
	t.Helper()
	start := f.Stats().Polls
	require.Eventually(t, func() bool { return f.Stats().Polls >= start+k }, eventuallyTimeout, 5*time.Millisecond)
}

func schemaAdapter(o *outbox.Outbox) *wsql.DefaultPostgreSQLSchema {
	s, _ := outbox.Adapters(o)
	return s
}

func offsetsAdapter(o *outbox.Outbox) wsql.DefaultPostgreSQLOffsetsAdapter {
	_, off := outbox.Adapters(o)
	return off
}
