package idemkafka_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// progressRig is a topic of two partitions with ten records each, a dedup
// table, and watermill-kafka subscribers built by WatermillSubscriberConfig
// with Progress, whose messages go through the dedup middleware.
type progressRig struct {
	t      *testing.T
	broker *kafkatest.Broker
	db     *pgtest.DB
	topic  string
	group  string
	table  deduplicator.TableConfig
	dedup  *idem.Dedup
}

func newProgressRig(t *testing.T) *progressRig {
	ctx := context.Background()
	broker := kafkatest.Start(t)
	db := pgtest.New(t, 8)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	topic := broker.Topic(t, "progress", 2)
	// The dedup group differs from the Kafka group, as a retry topic's
	// subscriber's does: the middleware must still leave the position to
	// the subscriber.
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)
	r := &progressRig{t: t, broker: broker, db: db, topic: topic, group: "progress-" + topic, table: table, dedup: d}
	r.produce(20)
	return r
}

// produce writes n records, alternately on partitions 0 and 1, each with
// a fresh UUIDv7 event id.
func (r *progressRig) produce(n int) {
	pcfg := sarama.NewConfig()
	pcfg.Producer.Return.Successes = true
	pcfg.Producer.Partitioner = sarama.NewManualPartitioner
	prod, err := sarama.NewSyncProducer(r.broker.Addrs, pcfg)
	require.NoError(r.t, err)
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		_, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: r.topic, Partition: int32(i % 2), Value: sarama.ByteEncoder(m.Payload),
			Headers: []sarama.RecordHeader{
				{Key: []byte("_watermill_message_uuid"), Value: []byte(m.UUID)},
				{Key: []byte(publisher.MetadataEventID), Value: []byte(uuid.Must(uuid.NewV7()).String())},
			}})
		require.NoError(r.t, err)
	}
	require.NoError(r.t, prod.Close())
}

// subscribe starts a subscriber of the group; the returned function closes it.
func (r *progressRig) subscribe(progress bool) (<-chan *message.Message, func()) {
	base := sarama.NewConfig()
	base.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	cc := idemkafka.ClientConfig{Brokers: r.broker.Addrs, Sarama: base}
	if progress {
		cc.Progress, cc.ProgressSchema = r.db.Pool, r.db.Schema
	}
	sc, err := idemkafka.WatermillSubscriberConfig(cc, r.group)
	require.NoError(r.t, err)
	sub, err := kafka.NewSubscriber(sc, watermill.NopLogger{})
	require.NoError(r.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, r.topic)
	require.NoError(r.t, err)
	return ch, func() { cancel(); require.NoError(r.t, sub.Close()) }
}

// consume runs n messages of ch through the dedup middleware and acks
// them; it returns the first offset seen per partition.
func (r *progressRig) consume(ch <-chan *message.Message, n int) map[int32]int64 {
	h := r.dedup.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	first := map[int32]int64{}
	for i := range n {
		select {
		case m := <-ch:
			p, _ := kafka.MessagePartitionFromCtx(m.Context())
			off, _ := kafka.MessagePartitionOffsetFromCtx(m.Context())
			if _, ok := first[p]; !ok {
				first[p] = off
			}
			_, err := h(m)
			require.NoError(r.t, err)
			m.Ack()
		case <-time.After(30 * time.Second):
			r.t.Fatalf("no message after %d of %d", i, n)
		}
	}
	return first
}

// positions returns PostgreSQL's position and Kafka's committed offset
// (-1: none) per partition.
func (r *progressRig) positions() (pg, kf map[int32]int64) {
	pg, kf = map[int32]int64{}, map[int32]int64{}
	rows, err := r.db.Pool.Query(context.Background(), "SELECT kafka_partition, next_offset FROM processed_event_progress WHERE consumer_group = $1 AND topic = $2", r.group, r.topic)
	require.NoError(r.t, err)
	for rows.Next() {
		var p int32
		var n int64
		require.NoError(r.t, rows.Scan(&p, &n))
		pg[p] = n
	}
	require.NoError(r.t, rows.Err())
	admin, err := sarama.NewClusterAdmin(r.broker.Addrs, sarama.NewConfig())
	require.NoError(r.t, err)
	defer admin.Close()
	res, err := admin.ListConsumerGroupOffsets(r.group, map[string][]int32{r.topic: {0, 1}})
	require.NoError(r.t, err)
	for p := range int32(2) {
		kf[p] = -1
		if b := res.GetBlock(r.topic, p); b != nil {
			kf[p] = b.Offset
		}
	}
	return pg, kf
}

// With Progress, the subscriber writes its positions to PostgreSQL and
// commits an offset to Kafka only once PostgreSQL holds it, and every
// claim starts from PostgreSQL's position: a position behind Kafka's (what
// a failover to an asynchronous standby leaves) hands the records between
// out again. The dedup middleware writes no position of its own then, and
// counts nothing as ahead.
func TestWatermillSubscriberKeepsItsPositionsInPostgres(t *testing.T) {
	t.Parallel()
	r := newProgressRig(t)
	ch, closeSub := r.subscribe(true)
	require.Equal(t, map[int32]int64{0: 0, 1: 0}, r.consume(ch, 20))
	require.Eventually(t, func() bool {
		pg, kf := r.positions()
		for p := range int32(2) {
			require.LessOrEqual(t, kf[p], max(pg[p], -1), "Kafka committed an offset PostgreSQL does not hold yet")
		}
		return pg[0] == 10 && pg[1] == 10 && kf[0] == 10 && kf[1] == 10
	}, 20*time.Second, 20*time.Millisecond)
	closeSub()
	require.Zero(t, r.db.Count(t, "SELECT 1 FROM processed_event_progress WHERE consumer_group = 'billing'"), "the middleware wrote positions of its own")

	// A failover lost the last six transactions of each partition, and
	// their position writes with them; Kafka's offsets stayed at 10.
	r.db.Exec(t, "UPDATE processed_event_progress SET next_offset = 4")
	r.db.Exec(t, "DELETE FROM processed_event WHERE event_id IN (SELECT event_id FROM processed_event ORDER BY event_id DESC LIMIT 12)")
	ch, closeSub = r.subscribe(true)
	defer closeSub()
	require.Equal(t, map[int32]int64{0: 4, 1: 4}, r.consume(ch, 12), "each partition starts from PostgreSQL's position")
	require.Zero(t, r.dedup.Stats().KafkaAhead)
	require.Equal(t, 20, r.db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = 'billing'"))
}

// The order of the two writes: while PostgreSQL refuses the positions,
// Kafka's committed offsets do not move, however many messages are acked;
// once it takes them again, both move.
func TestWatermillSubscriberCommitsToKafkaOnlyWhatPostgresHolds(t *testing.T) {
	t.Parallel()
	r := newProgressRig(t)
	r.db.Exec(t, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'refused'; END$$`)
	r.db.Exec(t, "CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON processed_event_progress FOR EACH ROW EXECUTE FUNCTION refuse()")
	r.db.Exec(t, "ALTER TABLE processed_event_progress DISABLE TRIGGER refuse")
	ch, closeSub := r.subscribe(true)
	defer closeSub()
	r.consume(ch, 20)
	require.Eventually(t, func() bool {
		pg, kf := r.positions()
		return pg[0] == 10 && pg[1] == 10 && kf[0] == 10 && kf[1] == 10
	}, 20*time.Second, 20*time.Millisecond)

	r.db.Exec(t, "ALTER TABLE processed_event_progress ENABLE TRIGGER refuse")
	r.produce(20)
	r.consume(ch, 20)
	// Many flush intervals (50 ms) and auto-commit intervals (100 ms).
	time.Sleep(time.Second)
	pg, kf := r.positions()
	require.Equal(t, map[int32]int64{0: 10, 1: 10}, pg)
	require.Equal(t, map[int32]int64{0: 10, 1: 10}, kf, "Kafka committed offsets PostgreSQL could not take")

	r.db.Exec(t, "ALTER TABLE processed_event_progress DISABLE TRIGGER refuse")
	require.Eventually(t, func() bool {
		pg, kf := r.positions()
		return pg[0] == 20 && pg[1] == 20 && kf[0] == 20 && kf[1] == 20
	}, 20*time.Second, 20*time.Millisecond)
}

func TestWatermillSubscriberProgressRefusesCooperativeSticky(t *testing.T) {
	lazy, err := pgxpool.New(context.Background(), "postgres://nowhere.invalid/db") // connects on first use only
	require.NoError(t, err)
	defer lazy.Close()
	base := sarama.NewConfig()
	base.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	_, err = idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"localhost:9092"}, Sarama: base, Progress: lazy}, "g")
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "Progress"), err.Error())
}

// The subscriber closes (its session ends) while a flush is paused at each
// of its steps, with marks made after the paused flush read them: the
// claims' last flush writes them, Kafka's committed offsets never pass
// PostgreSQL's positions, and the next subscriber starts where PostgreSQL
// says, losing nothing and reading nothing twice. Not parallel: the hook
// is the package's.
func TestWatermillSubscriberClosingDuringAFlush(t *testing.T) {
	for _, at := range []string{"collected", "saved", "marked"} {
		t.Run(at, func(t *testing.T) {
			r := newProgressRig(t)
			paused, release, marked := make(chan struct{}), make(chan struct{}), make(chan struct{}, 20)
			var once sync.Once
			restore := idemkafka.SetProgressStep(func(step string) {
				switch step {
				case at:
					once.Do(func() { close(paused); <-release })
				case "mark":
					marked <- struct{}{}
				}
			})
			defer restore()
			ch, closeSub := r.subscribe(true)
			r.consume(ch, 10)
			<-paused          // the periodic flush holds the marks of some of the 10
			r.consume(ch, 10) // marked while it waits
			for range 20 {    // watermill-kafka marks after the ack, on its own goroutine
				<-marked
			}
			closed := make(chan struct{})
			go func() { closeSub(); close(closed) }()
			time.Sleep(200 * time.Millisecond) // let the close begin (a schedule, not a bound)
			close(release)
			<-closed
			pg, kf := r.positions()
			require.Equal(t, map[int32]int64{0: 10, 1: 10}, pg, "the claims' last flush wrote every mark")
			for p := range int32(2) {
				require.LessOrEqual(t, kf[p], pg[p], "Kafka committed an offset PostgreSQL does not hold")
			}
			r.produce(2)
			ch, closeSub = r.subscribe(true)
			defer closeSub()
			require.Equal(t, map[int32]int64{0: 10, 1: 10}, r.consume(ch, 2), "the next subscriber starts at PostgreSQL's positions")
		})
	}
}
