package failover_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

const (
	partitions = 4
	keys       = 8
	perPhase   = 200
)

// kafkaOnly is the run that shows the tests failing without this change:
// the position kept only in Kafka.
var kafkaOnly = os.Getenv("IDEM_FAILOVER_PROGRESS") == "off"

type kind int

const (
	parallelSub          kind = iota // idemkafka/parallel: seeks to PostgreSQL's position
	watermillSub                     // watermill-kafka's: the operator's rewind
	watermillGroupCommit             // the same with the middleware's group commit
	franzSub                         // idemkafka/franz, classic cooperative-sticky: starts from PostgreSQL's position
	franzKIP848                      // the same on the KIP-848 consumer protocol
	watermillProgress                // watermill-kafka's with idemkafka.ClientConfig.Progress: starts from PostgreSQL's position
)

// seeks reports whether k's subscriber starts from PostgreSQL's position
// itself (no operator's rewind).
func (k kind) seeks() bool {
	return k == parallelSub || k == franzSub || k == franzKIP848 || k == watermillProgress
}

// rig is one test's topic, group and producer.
type rig struct {
	t      *testing.T
	kind   kind
	broker *kafkatest.Broker
	topic  string
	group  string
	seq    map[string]int
	total  int
	prod   sarama.SyncProducer
	logger watermill.LoggerAdapter
}

func newRig(t *testing.T, k kind) *rig {
	broker := kafkatest.Start(t)
	cfg := sarama.NewConfig()
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	prod, err := sarama.NewSyncProducer(broker.Addrs, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = prod.Close() })
	return &rig{t: t, kind: k, broker: broker, topic: broker.Topic(t, "failover", partitions), group: "failover-" + strconv.Itoa(int(k)),
		seq: map[string]int{}, prod: prod, logger: watermill.NewStdLogger(false, false)}
}

// setup creates the tables on db: the claims (and progress), and applied,
// the business rows (n orders them as they commit per key).
func (r *rig) setup(c *pgcluster.Cluster) {
	ctx := context.Background()
	conn := c.Conn(ctx)
	require.NoError(r.t, migrate.Up(ctx, conn, deduplicator.MigrationLine(deduplicator.TableConfig{})))
	_, err := conn.Exec(ctx, "CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, seq int NOT NULL)")
	require.NoError(r.t, err)
}

// produce writes n events, round-robin over the keys, each with its key's
// next sequence number.
func (r *rig) produce(n int) {
	for range n {
		key := "k" + strconv.Itoa(r.total%keys)
		r.total++
		r.seq[key]++
		id := uuid.Must(uuid.NewV7())
		body, _ := json.Marshal(map[string]any{"key": key, "seq": r.seq[key]})
		_, _, err := r.prod.SendMessage(&sarama.ProducerMessage{Topic: r.topic, Key: sarama.StringEncoder(key), Value: sarama.ByteEncoder(body),
			Headers: []sarama.RecordHeader{{Key: []byte("event_id"), Value: []byte(id.String())}}})
		require.NoError(r.t, err)
	}
}

// consume runs a consumer of the group on c (a cluster, or a proxy in
// front of one) until the returned stop.
func (r *rig) consume(c interface{ URL() string }) (stop func(), dedup *idem.Dedup) {
	t := r.t
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(c.URL())
	require.NoError(t, err)
	pcfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	dcfg := idem.Config{DB: pool, ConsumerGroup: r.group, SkipProgress: kafkaOnly, Concurrency: 8}
	if r.kind == watermillGroupCommit {
		dcfg.Mode = &idem.GroupCommitConfig{}
	}
	dedup, err = idem.NewDedup(dcfg, r.logger)
	require.NoError(t, err)
	client := idemkafka.ClientConfig{Brokers: r.broker.Addrs}
	var sub message.Subscriber
	switch r.kind {
	case parallelSub:
		cfg := parallel.SubscriberConfig{Client: client, ConsumerGroup: r.group, MaxInFlight: 8}
		if !kafkaOnly {
			cfg.Progress = pool
		}
		sub, err = parallel.NewSubscriber(cfg, r.logger)
	case franzSub, franzKIP848:
		cfg := franz.SubscriberConfig{Brokers: r.broker.Addrs, ConsumerGroup: r.group, MaxInFlight: 8}
		if r.kind == franzKIP848 {
			cfg.GroupProtocol = "consumer"
		}
		if !kafkaOnly {
			cfg.Progress = pool
		}
		sub, err = franz.NewSubscriber(cfg, r.logger)
	case watermillSub, watermillGroupCommit, watermillProgress:
		if r.kind == watermillProgress && !kafkaOnly {
			client.Progress = pool
		}
		var cfg kafka.SubscriberConfig
		cfg, err = idemkafka.WatermillSubscriberConfig(client, r.group)
		require.NoError(t, err)
		sub, err = kafka.NewSubscriber(cfg, r.logger)
	}
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, r.logger)
	require.NoError(t, err)
	router.AddMiddleware(dedup.Middleware)
	router.AddConsumerHandler("apply", r.topic, sub, apply)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		_ = router.Close()
		_ = sub.Close()
		pool.Close()
	}
	t.Cleanup(stop)
	return stop, dedup
}

// apply is the business: one row per event, in the claim's transaction.
func apply(m *message.Message) error {
	var e struct {
		Key string `json:"key"`
		Seq int    `json:"seq"`
	}
	if err := json.Unmarshal(m.Payload, &e); err != nil {
		return idem.Permanent(err)
	}
	ctx := m.Context()
	id, _ := idem.EventIDFromContext(ctx)
	_, err := idem.MustTxFromContext(ctx).Exec(ctx, "INSERT INTO applied (event_id, key, seq) VALUES ($1, $2, $3)", id, e.Key, e.Seq)
	return err
}

// count returns query's single integer on c.
func count(t *testing.T, c *pgcluster.Cluster, query string, args ...any) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL())
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	require.NoError(t, conn.QueryRow(ctx, query, args...).Scan(&n))
	return n
}

// waitFor polls query on c until it returns want, for up to d; it returns
// the last value.
func waitFor(t *testing.T, c *pgcluster.Cluster, d time.Duration, want int, query string, args ...any) int {
	t.Helper()
	deadline := time.Now().Add(d)
	var got int
	for {
		got = count(t, c, query, args...)
		if got == want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitApplied waits until every event produced so far is applied on c.
func (r *rig) waitApplied(c *pgcluster.Cluster, d time.Duration) {
	r.t.Helper()
	got := waitFor(r.t, c, d, r.total, "SELECT count(DISTINCT event_id) FROM applied")
	require.Equal(r.t, r.total, got, "events applied on port %d: %d of %d (%d lost)", c.Port, got, r.total, r.total-got)
}

// waitProgress waits until PostgreSQL's position covers every event
// produced so far (nothing with the position in Kafka only).
func (r *rig) waitProgress(c *pgcluster.Cluster) {
	r.t.Helper()
	if kafkaOnly {
		return
	}
	got := waitFor(r.t, c, time.Minute, r.total, "SELECT coalesce(sum(next_offset), 0)::int FROM processed_event_progress WHERE consumer_group = $1", r.group)
	require.Equal(r.t, r.total, got, "PostgreSQL's position")
}

// waitCommitted waits until the group's committed Kafka offsets cover
// every event produced so far.
func (r *rig) waitCommitted() {
	r.t.Helper()
	admin, err := sarama.NewClusterAdmin(r.broker.Addrs, sarama.NewConfig())
	require.NoError(r.t, err)
	defer admin.Close()
	parts := make([]int32, partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := admin.ListConsumerGroupOffsets(r.group, map[string][]int32{r.topic: parts})
		require.NoError(r.t, err)
		sum := 0
		for _, b := range resp.Blocks[r.topic] {
			sum += int(max(b.Offset, 0))
		}
		if sum == r.total {
			return
		}
		require.False(r.t, time.Now().After(deadline), "Kafka's committed offsets cover %d of %d", sum, r.total)
		time.Sleep(200 * time.Millisecond)
	}
}

// moveTo moves the consumers to c, the database that lost the last lost
// events. The parallel and franz subscribers, and watermill-kafka's with
// ClientConfig.Progress, need nothing: they start from c's position. For watermill-kafka's subscriber the operator first finds the
// partitions whose committed Kafka offset is ahead of c's position
// (idemctl groups progress) and rewinds them (--rewind); with
// restartFirst, the consumers restart on c before that, as they were: the
// middleware reports the records they skipped past PostgreSQL's position
// (Stats.KafkaAhead, a log line naming the rewind) and keeps that
// position, so the operator's rewind, later, still finds them.
func (r *rig) moveTo(c *pgcluster.Cluster, lost int, restartFirst bool) {
	t := r.t
	if !r.kind.seeks() && !kafkaOnly {
		if restartFirst {
			stop, dedup := r.consume(c)
			before := count(t, c, "SELECT count(*) FROM applied")
			r.produce(keys)
			require.Equal(t, before+keys, waitFor(t, c, time.Minute, before+keys, "SELECT count(*) FROM applied"), "the new events flow")
			require.GreaterOrEqual(t, dedup.Stats().KafkaAhead, uint64(lost), "the middleware saw the subscriber start past PostgreSQL's position")
			stop()
		}
		ctx := context.Background()
		client, err := sarama.NewClient(r.broker.Addrs, sarama.NewConfig())
		require.NoError(t, err)
		defer client.Close()
		rows, err := progresskafka.Compare(ctx, c.Conn(ctx), progresssql.Table("public", "processed_event"), r.group, client, r.group, r.topic)
		require.NoError(t, err)
		var ahead int64
		for _, row := range rows {
			ahead += row.Ahead()
		}
		require.GreaterOrEqual(t, ahead, int64(lost), "Kafka's committed offsets ahead of PostgreSQL's position")
		_, err = progresskafka.Rewind(client, r.group, rows)
		require.NoError(t, err)
		t.Logf("Kafka's committed offsets were %d ahead of PostgreSQL's position: rewound", ahead)
	}
	r.consume(c)
}

// check asserts that every event was applied exactly once on c, each key's
// events in their order when ordered.
func (r *rig) check(c *pgcluster.Cluster, ordered bool) {
	t := r.t
	require.Equal(t, r.total, count(t, c, "SELECT count(*) FROM applied"), "rows applied (a double shows here)")
	require.Equal(t, r.total, count(t, c, "SELECT count(DISTINCT event_id) FROM applied"))
	if ordered {
		outOfOrder := count(t, c, `SELECT count(*) FROM (
			SELECT seq, row_number() OVER (PARTITION BY key ORDER BY n) AS rn FROM applied) s WHERE seq <> rn`)
		require.Zero(t, outOfOrder, "events applied out of their key's order")
	}
	for k, n := range r.seq {
		require.Equal(t, n, count(t, c, "SELECT count(*) FROM applied WHERE key = $1", k), "key %s", k)
	}
	t.Logf("%d events applied exactly once (in key order: %v) on port %d", r.total, ordered, c.Port)
}

func (r *rig) String() string { return fmt.Sprintf("%s group %s", r.topic, r.group) }
