package failover_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// TestFailoverWithRetryTopics_Parallel: events fail on their first run and
// go through a retry topic with KeyOrder (their key's later events wait in
// PostgreSQL) while the primary loses its standby; every event is applied
// once, in its key's order, on the promoted standby. Two things the
// promotion undoes are checked: the copies of events parked before the cut
// are consumed after it, on retry partitions with no record processed
// before it (their subscriber wrote where they start at assignment, so
// they start there again); and copies published after the cut, whose
// parked rows the standby lacks while their keys are free there, are acked
// without running (their events come again from the main topic, behind
// their key's earlier events that the promotion undid).
func TestFailoverWithRetryTopics_Parallel(t *testing.T) {
	t.Parallel()
	failoverRetry(t, parallelSub)
}

// TestFailoverWithRetryTopics_WatermillKafka: the same with
// watermill-kafka's subscribers; the retry topic's subscriber is in a
// Kafka group of its own, named in the middleware's Config.KafkaGroups, and
// the operator's rewind moves both groups back to PostgreSQL's positions.
func TestFailoverWithRetryTopics_WatermillKafka(t *testing.T) {
	t.Parallel()
	failoverRetry(t, watermillSub)
}

// retryBackoff delays each copy, so that the copies of the events parked
// before the cut are consumed after it.
const retryBackoff = 4 * time.Second

func failoverRetry(t *testing.T, k kind) {
	env := pgcluster.New(t)
	r := newRig(t, k)
	rr := &retryRig{rig: r, retryTopic: r.broker.Topic(t, "failover-retry", partitions), retryGroup: r.group + "-retry"}
	primary := env.Primary("primary", "")
	r.setup(primary)
	rr.setup(primary)
	standby := primary.Standby("standby")

	// Before the cut: every event is applied or parked; no copy is due yet.
	r.produce(perPhase)
	stop := rr.consume(primary)
	settled := waitFor(t, primary, time.Minute, r.total,
		"SELECT (SELECT count(DISTINCT event_id) FROM applied) + (SELECT count(*) FROM retry_parked_key)")
	require.Equal(t, r.total, settled, "events applied or parked before the cut")
	require.Positive(t, count(t, primary, "SELECT count(*) FROM retry_parked_key"), "events parked before the cut")
	standby.CaughtUp(primary)

	standby.CutReplication()
	r.produce(perPhase)
	r.waitApplied(primary, 2*time.Minute)
	require.Zero(t, waitFor(t, primary, time.Minute, 0, "SELECT count(*) FROM retry_parked_key"), "keys parked on the primary")
	rr.waitCommitted(r.group, r.topic)
	rr.waitCommitted(rr.retryGroup, rr.retryTopic)
	stop()
	primary.StopImmediate()
	standby.Promote()
	lost := r.total - count(t, standby, "SELECT count(*) FROM applied")
	require.Positive(t, lost, "the cut left the standby behind")
	t.Logf("the promoted standby lacks %d of %d events and has %d parked", lost, r.total, count(t, standby, "SELECT count(*) FROM retry_parked_key"))

	if k != parallelSub {
		rr.rewind(standby, r.group, r.topic)
		rr.rewind(standby, rr.retryGroup, rr.retryTopic)
	}
	rr.consume(standby)
	r.produce(keys * 5) // traffic goes on
	r.waitApplied(standby, 2*time.Minute)
	require.Zero(t, waitFor(t, standby, time.Minute, 0, "SELECT count(*) FROM retry_parked_key"), "keys left parked on the promoted standby")
	r.check(standby, true)
}

// retryRig adds a retry topic with KeyOrder to a rig.
type retryRig struct {
	*rig
	retryTopic string
	retryGroup string
	ob         *outbox.Outbox
}

// setup creates the parked-keys table and the outbox table of the
// hand-offs on c.
func (rr *retryRig) setup(c *pgcluster.Cluster) {
	ctx := context.Background()
	conn := c.Conn(ctx)
	var err error
	rr.ob, err = outbox.New(outbox.Config{Topics: []string{rr.retryTopic}}, nil)
	require.NoError(rr.t, err)
	require.NoError(rr.t, migrate.Up(ctx, conn, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{})))
	require.NoError(rr.t, migrate.Up(ctx, conn, outbox.MigrationLine(rr.ob.Config(), rr.retryTopic)))
}

// failFirst fails every tenth event of a key (seq 3, 13, ...) when it
// comes from the main topic (its copy on the retry topic succeeds): for
// the keys k0-k3 from their first events on, for k4-k7 only after the cut
// (seq past perPhase/keys), so that these keys are free on the promoted
// standby while copies published after the cut are on the retry topic.
func failFirst(retryTopic string) message.NoPublishHandlerFunc {
	return func(m *message.Message) error {
		var e struct {
			Key string `json:"key"`
			Seq int    `json:"seq"`
		}
		_ = json.Unmarshal(m.Payload, &e)
		early := e.Key < "k4" || e.Seq > perPhase/keys
		if e.Seq%10 == 3 && early && message.SubscribeTopicFromCtx(m.Context()) != retryTopic {
			return errors.New("fails on the main topic")
		}
		return apply(m)
	}
}

// consume runs the main and the retry consumers of the group on c, and
// the forwarder of the hand-offs, until the returned stop.
func (rr *retryRig) consume(c *pgcluster.Cluster) (stop func()) {
	t := rr.t
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(c.URL())
	require.NoError(t, err)
	pcfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	client := idemkafka.ClientConfig{Brokers: rr.broker.Addrs}
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: rr.group, Concurrency: 8, KafkaGroups: []string{rr.retryGroup}}, rr.logger)
	require.NoError(t, err)
	pubCfg, err := idemkafka.WatermillPublisherConfig(client)
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, rr.logger)
	require.NoError(t, err)
	rt, err := retrytopic.New(retrytopic.Config{Publisher: pub, Topics: []string{rr.retryTopic}, PoisonTopic: rr.retryTopic + "-poison",
		Backoff:  retrytopic.Backoff{Initial: retryBackoff, Max: retryBackoff, Jitter: retrytopic.NoJitter},
		KeyOrder: &retrytopic.KeyOrder{DB: pool, Outbox: rr.ob, ConsumerGroup: rr.group}}, rr.logger)
	require.NoError(t, err)
	producer, err := idemkafka.NewSyncProducer(client)
	require.NoError(t, err)
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: pool, Outbox: rr.ob, Producer: producer, PollInterval: 20 * time.Millisecond}, rr.logger)
	require.NoError(t, err)
	go func() { _ = fwd.Run(ctx) }()

	subscriber := func(group string, hold bool) message.Subscriber {
		var sub message.Subscriber
		if rr.kind == parallelSub {
			sub, err = parallel.NewSubscriber(parallel.SubscriberConfig{Client: client, ConsumerGroup: group, MaxInFlight: 8, Progress: pool}, rr.logger)
		} else {
			var cfg kafka.SubscriberConfig
			cfg, err = idemkafka.WatermillSubscriberConfig(client, group)
			require.NoError(t, err)
			if hold {
				cfg.Tracer = retrytopic.HoldingTracer(cfg.Tracer)
			}
			sub, err = kafka.NewSubscriber(cfg, rr.logger)
		}
		require.NoError(t, err)
		return sub
	}
	sub, retrySub := subscriber(rr.group, false), subscriber(rr.retryGroup, true)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, rr.logger)
	require.NoError(t, err)
	router.AddMiddleware(rt.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
	router.AddConsumerHandler("apply", rr.topic, sub, failFirst(rr.retryTopic))
	router.AddConsumerHandler("apply-retry", rr.retryTopic, retrySub, failFirst(rr.retryTopic))
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
		_ = retrySub.Close()
		_ = fwd.Close()
		_ = producer.Close()
		_ = pub.Close()
		pool.Close()
	}
	t.Cleanup(stop)
	return stop
}

// waitCommitted waits until kafkaGroup's committed offsets reach the end
// of every partition of topic.
func (rr *retryRig) waitCommitted(kafkaGroup, topic string) {
	t := rr.t
	client, err := sarama.NewClient(rr.broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(t, err)
	parts := make([]int32, partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := admin.ListConsumerGroupOffsets(kafkaGroup, map[string][]int32{topic: parts})
		require.NoError(t, err)
		behind := int64(0)
		for _, p := range parts {
			end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
			require.NoError(t, err)
			if b := resp.GetBlock(topic, p); b == nil || b.Offset < end {
				behind++
			}
		}
		if behind == 0 {
			return
		}
		require.False(t, time.Now().After(deadline), "%s's committed offsets on %s: %d partitions behind", kafkaGroup, topic, behind)
		time.Sleep(200 * time.Millisecond)
	}
}

// rewind is the operator's step for watermill-kafka's subscribers: Kafka
// group kafkaGroup's committed offsets on topic go back to the position the
// middleware keeps in PostgreSQL under the dedup consumer group.
func (rr *retryRig) rewind(c *pgcluster.Cluster, kafkaGroup, topic string) {
	t := rr.t
	ctx := context.Background()
	client, err := sarama.NewClient(rr.broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	rows, err := progresskafka.Compare(ctx, c.Conn(ctx), progresssql.Table("public", "processed_event"), rr.group, client, kafkaGroup, topic)
	require.NoError(t, err)
	moved, err := progresskafka.Rewind(client, kafkaGroup, rows)
	require.NoError(t, err)
	t.Logf("%s on %s: rewound %v", kafkaGroup, topic, moved)
}
