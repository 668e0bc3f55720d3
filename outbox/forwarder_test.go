package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type payload struct {
	Aggregate string `json:"aggregate"`
	Seq       int    `json:"seq"`
}

func decode(t *testing.T, v string) payload {
	t.Helper()
	var p payload
	require.NoError(t, json.Unmarshal([]byte(v), &p))
	return p
}

// requirePerKeyOrder checks that every aggregate's records are in one
// partition with seq 0, 1, 2, ... in offset order.
func requirePerKeyOrder(t *testing.T, recs []record, perKey int) {
	t.Helper()
	next := map[string]int{}
	part := map[string]int32{}
	for _, r := range recs {
		p := decode(t, r.Value)
		require.Equal(t, p.Aggregate, r.Key)
		if pt, ok := part[r.Key]; ok {
			require.Equal(t, pt, r.Partition, "aggregate %s spans partitions", r.Key)
		}
		part[r.Key] = r.Partition
		require.Equal(t, next[r.Key], p.Seq, "aggregate %s out of order at partition %d offset %d", r.Key, r.Partition, r.Offset)
		next[r.Key]++
	}
	for k, n := range next {
		require.Equal(t, perKey, n, "aggregate %s", k)
	}
}

func TestForwarder_PerAggregateOrder10k(t *testing.T) {
	t.Parallel()
	const (
		writers      = 5
		perWriter    = 10 // aggregates
		perAggregate = 200
		total        = writers * perWriter * perAggregate
	)
	e := newEnv(t, 12)
	topic := e.topic(t, "order", 4)
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})

	// Writers publish concurrently, so transaction ids interleave; each
	// aggregate belongs to one writer, which publishes its events in order.
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := 0; seq < perAggregate; seq++ {
				msgs := make([]*message.Message, 0, perWriter)
				for a := 0; a < perWriter; a++ {
					msgs = append(msgs, event(fmt.Sprintf("agg-%02d", w*perWriter+a), seq))
				}
				e.publishTx(t, topic, msgs...)
			}
		}()
	}
	wg.Wait()

	recs := consume(t, e.broker.Addrs, topic, total)
	require.Zero(t, f.Stats().Errors)
	require.Len(t, recs, total)
	requirePerKeyOrder(t, recs, perAggregate)
}

func TestForwarder_LongRunningTransactionIsNotSkipped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "slow", 1)
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})

	e.publishTx(t, topic, event("warm-up", 0))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 1 }, eventuallyTimeout, 5*time.Millisecond)

	// A slow transaction writes its event first (lower offset and
	// transaction id) and stays open.
	slow, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer slow.Rollback(ctx)
	require.NoError(t, e.outbox.Publisher(slow).Publish(topic, event("order-1", 0)))

	// A later transaction commits events behind it: they are forwarded
	// while the slow transaction is still open (nothing waits for it).
	e.publishTx(t, topic, event("order-1", 1), event("order-2", 0))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 3 }, eventuallyTimeout, 5*time.Millisecond)

	// Its row is not skipped: it is forwarded once it commits, after the
	// rows of every transaction that committed before it.
	require.NoError(t, slow.Commit(ctx))
	recs := consume(t, e.broker.Addrs, topic, 4)
	require.Len(t, recs, 4)
	var got []string
	for _, r := range recs {
		p := decode(t, r.Value)
		got = append(got, fmt.Sprintf("%s/%d", p.Aggregate, p.Seq))
	}
	require.Equal(t, []string{"warm-up/0", "order-1/1", "order-2/0", "order-1/0"}, got, "commit order")
}

// service runs a Watermill router consuming topic in group with the dedup
// middleware (Outbox set). When outTopic is set, the messages h returns go
// to the outbox for outTopic in the same transaction.
func (e *env) service(t *testing.T, topic, group, outTopic string, h message.HandlerFunc) {
	t.Helper()
	ctx := context.Background()
	logger := watermill.NopLogger{}
	table := deduplicator.TableConfig{Schema: e.db.Schema}
	require.NoError(t, migrate.Up(ctx, e.db.Pool, deduplicator.MigrationLine(table)))
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: e.broker.Addrs}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	dedup, err := idem.NewDedup(idem.Config{DB: e.db.Pool, ConsumerGroup: group, Table: table, Outbox: e.outbox}, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(dedup.Middleware)
	if outTopic == "" {
		router.AddConsumerHandler(group, topic, sub, func(m *message.Message) error {
			_, err := h(m)
			return err
		})
	} else {
		router.AddHandler(group, topic, sub, outTopic, refusingPublisher{t}, h)
	}
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() {
		_ = router.Close()
		_ = sub.Close()
	})
	<-router.Running()
}

// refusingPublisher fails the test if the router publishes anything: with an
// outbox in the middleware, handler-returned messages must not reach it.
type refusingPublisher struct{ t *testing.T }

func (p refusingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.t.Errorf("router publisher got %d messages for %s; they should have gone to the outbox", len(msgs), topic)
	return fmt.Errorf("unexpected publish")
}
func (refusingPublisher) Close() error { return nil }

// groupOffsets returns the sum of group's committed offsets on topic.
func groupOffsets(t *testing.T, brokers []string, group, topic string) int64 {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer admin.Close()
	resp, err := admin.ListConsumerGroupOffsets(group, nil)
	require.NoError(t, err)
	var n int64
	for _, b := range resp.Blocks[topic] {
		if b.Offset > 0 {
			n += b.Offset
		}
	}
	return n
}

// crashingProducer sends batches through the real producer; right after the
// crashAt-th reached the broker, it does what a crash between Kafka's
// acknowledgement and the position's commit does: the forwarder's session
// ends (it terminates the PostgreSQL backend holding the position's row
// lock, whose transaction the server rolls back) and so does Run (stop).
// Later sends are refused, as a dead process sends nothing.
type crashingProducer struct {
	sarama.SyncProducer
	pool    *pgxpool.Pool
	offsets string // quoted offsets table: its row lock marks the forwarder's session
	crashAt int
	stop    context.CancelFunc

	mu      sync.Mutex
	batches int
	sent    int // records acknowledged by the broker
	crashed bool
	err     error // a failure of the crash itself
}

func (p *crashingProducer) SendMessages(msgs []*sarama.ProducerMessage) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.crashed {
		return errors.New("crashed: not sending")
	}
	if err := p.SyncProducer.SendMessages(msgs); err != nil {
		return err
	}
	p.batches++
	p.sent += len(msgs)
	if p.batches == p.crashAt {
		p.crashed = true
		p.err = p.terminateForwarderSession()
		p.stop()
	}
	return nil
}

func (p *crashingProducer) terminateForwarderSession() error {
	ctx := context.Background()
	var pids []int32
	err := p.pool.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT pid), '{}') FROM pg_locks
		WHERE locktype = 'relation' AND relation = to_regclass($1) AND mode = 'RowShareLock' AND pid <> pg_backend_pid()`, p.offsets).Scan(&pids)
	if err != nil {
		return err
	}
	if len(pids) != 1 {
		return fmt.Errorf("sessions holding the position lock: %v, want one", pids)
	}
	var ok bool
	if err := p.pool.QueryRow(ctx, `SELECT pg_terminate_backend($1, 30000)`, pids[0]).Scan(&ok); err != nil || !ok {
		return fmt.Errorf("terminate backend %d: %v %w", pids[0], ok, err)
	}
	return nil
}

func TestForwarder_CrashAndRestart_DedupAppliesOnce(t *testing.T) {
	t.Parallel()
	const (
		aggregates = 50
		perKey     = 40 // 2,000 events
		batch      = 100
		crashAfter = 5 // batches sent; the 5th is sent but its position never committed
	)
	ctx := context.Background()
	e := newEnv(t, 12)
	topic := e.topic(t, "crash", 4)
	e.db.Exec(t, `CREATE TABLE applied (event_id uuid NOT NULL, aggregate text NOT NULL, seq int NOT NULL)`)

	publishHalf := func(from, to int) {
		for seq := from; seq < to; seq++ {
			msgs := make([]*message.Message, 0, aggregates)
			for a := 0; a < aggregates; a++ {
				msgs = append(msgs, event(fmt.Sprintf("agg-%02d", a), seq))
			}
			e.publishTx(t, topic, msgs...)
		}
	}
	publishHalf(0, perKey/2)

	// First forwarder: dies right after sending its 5th batch, before the
	// position of that batch is committed.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	crashing := &crashingProducer{SyncProducer: e.producer(t), pool: e.db.Pool, offsets: outbox.OffsetsTable(e.outbox, topic), crashAt: crashAfter, stop: stop}
	f1, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: crashing, Topics: []string{topic}, BatchSize: batch}, nil)
	require.NoError(t, err)
	require.NoError(t, f1.Run(runCtx))
	require.NoError(t, crashing.err)
	require.True(t, crashing.crashed, "the forwarder stopped before its 5th batch")
	require.Positive(t, f1.Stats().Errors, "the transaction of the 5th batch failed")
	// How many rows a transaction covers depends on what the snapshot shows
	// (another test's open transaction holds xmin back), so count them.
	sentRows := crashing.sent
	unacked := sentRows - int(f1.Stats().Forwarded)
	require.Positive(t, unacked, "the crash left sent but unacknowledged rows")
	require.LessOrEqual(t, unacked, batch*4 /* BatchesPerTransaction's default */, "what is resent is at most one transaction's pages")
	require.EqualValues(t, sentRows, highWater(t, e.broker.Addrs, topic), "every sent batch reached Kafka")

	// The consuming service.
	group := topic + "-svc"
	e.service(t, topic, group, "", func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		p := decode(t, string(m.Payload))
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO applied VALUES ($1, $2, $3)`, id, p.Aggregate, p.Seq)
		return nil, err
	})

	// Restart while the producer keeps writing.
	f2 := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, BatchSize: batch})
	publishHalf(perKey/2, perKey)

	const total = aggregates * perKey
	wantRecords := int64(total + unacked) // the unacknowledged rows went out twice
	require.Eventually(t, func() bool {
		return int(f2.Stats().Forwarded) == total-int(f1.Stats().Forwarded)
	}, eventuallyTimeout, 10*time.Millisecond)
	require.EqualValues(t, wantRecords, highWater(t, e.broker.Addrs, topic))
	// Wait until the service consumed every record, duplicates included.
	require.Eventually(t, func() bool {
		return groupOffsets(t, e.broker.Addrs, group, topic) == wantRecords
	}, eventuallyTimeout, 50*time.Millisecond)

	require.Equal(t, total, e.db.Count(t, `SELECT 1 FROM applied`), "each event applied exactly once")
	require.Equal(t, total, e.db.Count(t, `SELECT DISTINCT event_id FROM applied`))
	require.Equal(t, total, e.db.Count(t, `SELECT DISTINCT aggregate, seq FROM applied`))

	// Every record arrived, and the last copy of each key's events is in order.
	recs := consume(t, e.broker.Addrs, topic, int(wantRecords))
	seen := map[string]bool{}
	for _, r := range recs {
		seen[r.Headers[publisher.MetadataEventID]] = true
	}
	require.Len(t, seen, total)
}

func TestForwarder_SameGroupInstancesDoNotDuplicate(t *testing.T) {
	t.Parallel()
	const n = 3000
	e := newEnv(t, 12)
	topic := e.topic(t, "replicas", 2)
	var fs []*outbox.Forwarder
	for i := 0; i < 3; i++ {
		fs = append(fs, e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, BatchSize: 100}))
	}
	for i := 0; i < n; i += 100 {
		msgs := make([]*message.Message, 0, 100)
		for j := i; j < i+100; j++ {
			msgs = append(msgs, event(fmt.Sprintf("agg-%02d", j%20), j/20))
		}
		e.publishTx(t, topic, msgs...)
	}
	forwarded := func() (sum uint64) {
		for _, f := range fs {
			sum += f.Stats().Forwarded
		}
		return sum
	}
	require.Eventually(t, func() bool { return forwarded() >= n }, eventuallyTimeout, 10*time.Millisecond)
	for _, f := range fs {
		waitPolls(t, f, 2)
	}
	require.EqualValues(t, n, forwarded(), "the position lock lets one instance at a time forward")
	require.EqualValues(t, n, highWater(t, e.broker.Addrs, topic))
	requirePerKeyOrder(t, consume(t, e.broker.Addrs, topic, n), n/20)
}

func TestForwarder_Lifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0, "orders")
	p := e.producer(t)

	// A topic without tables is refused at construction (TestNewForwarder_ChecksTables).
	_, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: p, Topics: []string{"never-migrated"}}, nil)
	require.ErrorIs(t, err, outbox.ErrTopicNotMigrated)

	// Topics default to the Outbox's; Close stops Run and may be repeated.
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: p, PollInterval: time.Millisecond}, nil)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	require.Eventually(t, func() bool { return f.Stats().Polls > 2 }, eventuallyTimeout, time.Millisecond)
	require.Error(t, f.Run(ctx), "a second Run is refused")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	require.NoError(t, f.Close())

	// Cancelling the context stops Run gracefully too.
	f, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: p}, nil)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	go func() { done <- f.Run(cctx) }()
	require.Eventually(t, func() bool { return f.Stats().Polls > 0 }, eventuallyTimeout, time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	_, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: p, Publisher: refusingPublisher{t}}, nil)
	require.ErrorContains(t, err, "set only one")
	_, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: p, Name: strings.Repeat("n", 256)}, nil)
	require.ErrorContains(t, err, "Name: longer than 255 bytes")
}

// A write in this process wakes the forwarder of its table: with every
// idle wait stretched to an hour, each row is forwarded as soon as its
// writer commits, also when the writer's Outbox is another value.
func TestForwarder_WakesOnWritesInThisProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	topic := e.topic(t, "wake", 1)
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}}, nil)
	require.NoError(t, err)
	outbox.StretchWaits(f, time.Hour)
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, f.Close())
		require.NoError(t, <-done)
	})

	other, err := outbox.New(e.outbox.Config(), nil)
	require.NoError(t, err)
	for i, pub := range []message.Publisher{e.outbox.PoolPublisher(e.db.Pool), e.outbox.PoolPublisher(e.db.Pool), other.PoolPublisher(e.db.Pool)} {
		require.NoError(t, pub.Publish(topic, event("a", i)))
		require.Eventually(t, func() bool { return f.Stats().Forwarded == uint64(i+1) }, eventuallyTimeout, 5*time.Millisecond, "row %d", i)
	}
	recs := consume(t, e.broker.Addrs, topic, 3)
	requirePerKeyOrder(t, recs, 3)
}

// In a dedup handler the middleware wakes the forwarders after its COMMIT,
// when the handler's rows have become visible: with every idle wait
// stretched to an hour, a row written well before the handler returns is
// still forwarded (a wake-up at the write would find nothing yet and leave
// the forwarder asleep), one message at a time and with group commit.
func TestForwarder_WokenAfterTheDedupCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 8)
	table := deduplicator.TableConfig{Schema: e.db.Schema}
	require.NoError(t, migrate.Up(ctx, e.db.Pool, deduplicator.MigrationLine(table)))
	e.kafka(t) // one broker for both modes
	for _, mode := range []struct {
		name string
		gc   *idem.GroupCommitConfig
	}{{"single", nil}, {"group commit", &idem.GroupCommitConfig{MaxMessages: 2, MaxWait: time.Millisecond, Concurrency: 1}}} {
		t.Run(mode.name, func(t *testing.T) {
			topic := e.topic(t, "woken", 1)
			f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}}, nil)
			require.NoError(t, err)
			outbox.StretchWaits(f, time.Hour)
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			defer func() {
				require.NoError(t, f.Close())
				require.NoError(t, <-done)
			}()
			dedup, err := idem.NewDedup(idem.Config{DB: e.db.Pool, ConsumerGroup: "woken-" + topic, Table: table, Outbox: e.outbox, Mode: mode.gc}, nil)
			require.NoError(t, err)
			handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				pub, err := e.outbox.PublisherFromContext(msg.Context())
				if err != nil {
					return nil, err
				}
				if err := pub.Publish(topic, event("a", 0)); err != nil {
					return nil, err
				}
				time.Sleep(100 * time.Millisecond) // the COMMIT comes well after the write
				return nil, nil
			})
			in := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
			_, err = publisher.Stamp(ctx, in)
			require.NoError(t, err)
			_, err = handler(in)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return f.Stats().Forwarded == 1 }, eventuallyTimeout, 5*time.Millisecond)
		})
	}
}
