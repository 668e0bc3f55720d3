package poison_test

import (
	"context"
	"encoding/json"
	"errors"
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
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// fixture: a ledger consumer on a main topic behind the documented chain
// (PoisonQueueWithFilter(IsPermanent), the dedup middleware), whose handler
// refuses unknown products until the catalogue is "fixed".
type fixture struct {
	db          *pgtest.DB
	broker      *kafkatest.Broker
	main        string
	poisonTopic string
	pub         message.Publisher
	dedup       *idem.Dedup
	fixed       atomic.Bool

	mu   sync.Mutex
	seen map[string]message.Metadata // event id -> metadata of the last run
}

type order struct {
	Product string `json:"product"`
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	db.Exec(t, `CREATE TABLE ledger (event_id uuid NOT NULL, product text NOT NULL)`)
	broker := kafkatest.Start(t)
	f := &fixture{db: db, broker: broker, seen: map[string]message.Metadata{}}
	f.main = broker.Topic(t, "orders", 2)
	f.poisonTopic = broker.Topic(t, "orders-poison", 1)
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	f.pub = pub
	f.dedup, err = idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: f.main + "-ledger", Table: deduplicator.TableConfig{Schema: db.Schema}}, nil)
	require.NoError(t, err)
	return f
}

func (f *fixture) run(t *testing.T) {
	t.Helper()
	logger := watermill.NopLogger{}
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: f.broker.Addrs}, f.main+"-ledger")
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	pq, err := wmiddleware.PoisonQueueWithFilter(f.pub, f.poisonTopic, idem.IsPermanent)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(pq, f.dedup.Middleware)
	router.AddConsumerHandler("ledger", f.main, sub, func(m *message.Message) error {
		var o order
		if err := json.Unmarshal(m.Payload, &o); err != nil {
			return idem.Permanent(err)
		}
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		f.mu.Lock()
		f.seen[id.String()] = m.Metadata
		f.mu.Unlock()
		if o.Product == "P-new" && !f.fixed.Load() {
			return idem.Permanent(fmt.Errorf("unknown product %s", o.Product))
		}
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, "INSERT INTO ledger (event_id, product) VALUES ($1, $2)", id, o.Product)
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
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
	})
	<-router.Running()
}

func (f *fixture) msg(product string) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(`{"product":"`+product+`"}`))
	m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	publisher.WithPartitionKey(m, "acct-"+product)
	return m
}

func (f *fixture) applied(t *testing.T, id string) int {
	return f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1::uuid", id)
}

// endOffsets returns the high-water mark of each partition of topic.
func endOffsets(t *testing.T, brokers []string, topic string) map[int32]int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer func() { _ = client.Close() }()
	ps, err := client.Partitions(topic)
	require.NoError(t, err)
	out := map[int32]int64{}
	for _, p := range ps {
		out[p], err = client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
	}
	return out
}

// The proof, against PostgreSQL and the broker: the poison topic
// holds an event that was never applied (refused until a fix) and one that
// was applied (poisoned on a later delivery). The dry run lists both and
// publishes nothing; the replay applies the first once, and the second is a
// duplicate for its claim. The replayed message carries its original
// headers and the poisoning in reason_poisoned_history.
func TestReplayAppliesTheNeverAppliedAndAbsorbsTheApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	f.run(t)
	neverApplied, applied := f.msg("P-new"), f.msg("P-old")
	neverApplied.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	require.NoError(t, f.pub.Publish(f.main, neverApplied, applied))
	neverID, appliedID := neverApplied.Metadata.Get(publisher.MetadataEventID), applied.Metadata.Get(publisher.MetadataEventID)
	eventually(t, func() bool { return f.applied(t, appliedID) == 1 }, "the known product is applied")

	// The applied event also reaches the poison topic, as watermill's
	// PoisonQueue would publish a later delivery it refused (say, a
	// redelivery during an outage of the catalogue).
	late := applied.Copy()
	late.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "permanent: catalogue unavailable")
	late.Metadata.Set(wmiddleware.PoisonedTopicKey, f.main)
	late.Metadata.Set(wmiddleware.PoisonedHandlerKey, "ledger")
	late.Metadata.Set(wmiddleware.PoisonedSubscriberKey, "kafka")
	require.NoError(t, f.pub.Publish(f.poisonTopic, late))

	cfg := poison.Config{Kafka: idemkafka.ClientConfig{Brokers: f.broker.Addrs}, Topic: f.poisonTopic, Publisher: f.pub}
	var res *poison.Result
	eventually(t, func() bool {
		var err error
		res, err = poison.List(ctx, cfg, nil)
		require.NoError(t, err)
		return res.Matched == 2
	}, "the poison topic holds both events")
	require.Equal(t, 0, f.applied(t, neverID))
	require.Zero(t, res.Replayed)
	byID := map[string]poison.Message{}
	for _, m := range res.Messages {
		byID[m.EventID] = m
		require.Equal(t, f.main, m.OriginalTopic)
		require.False(t, m.Replayed)
		require.Empty(t, m.Skipped)
	}
	require.Contains(t, byID[neverID].Reason, "unknown product P-new")
	require.Equal(t, "ledger", byID[neverID].Handler)
	require.Contains(t, byID[appliedID].Reason, "catalogue unavailable")

	// Filters: by reason, by event id, by time poisoned.
	only := func(fl poison.Filter) []string {
		c := cfg
		c.Filter = fl
		r, err := poison.List(ctx, c, nil)
		require.NoError(t, err)
		var ids []string
		for _, m := range r.Messages {
			ids = append(ids, m.EventID)
		}
		return ids
	}
	require.Equal(t, []string{neverID}, only(poison.Filter{Reason: "unknown product"}))
	require.Equal(t, []string{appliedID}, only(poison.Filter{EventIDs: []uuid.UUID{uuid.MustParse(appliedID)}}))
	require.Empty(t, only(poison.Filter{PoisonedFrom: time.Now().Add(time.Hour)}))
	require.Empty(t, only(poison.Filter{OriginalTopic: "payments"}))

	// A dry run of Replay publishes nothing.
	before := endOffsets(t, f.broker.Addrs, f.main)
	dry := cfg
	dry.DryRun = true
	res, err := poison.Replay(ctx, dry, nil)
	require.NoError(t, err)
	require.Equal(t, 2, res.Matched)
	require.Zero(t, res.Replayed)
	require.Equal(t, before, endOffsets(t, f.broker.Addrs, f.main), "a dry run publishes nothing")

	// The fix ships; the replay.
	f.fixed.Store(true)
	statsBefore := f.dedup.Stats()
	var listed []string
	cfg.OnMessageFunc = func(m poison.Message) { listed = append(listed, m.EventID) }
	res, err = poison.Replay(ctx, cfg, nil)
	require.NoError(t, err)
	require.Equal(t, 2, res.Replayed)
	require.Len(t, listed, 2)
	eventually(t, func() bool {
		s := f.dedup.Stats()
		return s.Processed == statsBefore.Processed+1 && s.Duplicates == statsBefore.Duplicates+1
	}, "the never-applied event is processed, the applied one is a duplicate")
	require.Equal(t, 1, f.applied(t, neverID))
	require.Equal(t, 1, f.applied(t, appliedID))
	require.Equal(t, 2, f.db.Count(t, "SELECT 1 FROM ledger"))

	f.mu.Lock()
	md := f.seen[neverID]
	f.mu.Unlock()
	require.Equal(t, neverApplied.Metadata.Get("traceparent"), md.Get("traceparent"), "original headers kept")
	require.Equal(t, "acct-P-new", md.Get(publisher.MetadataPartitionKey))
	require.Empty(t, md.Get(wmiddleware.ReasonForPoisonedKey))
	require.Empty(t, md.Get(wmiddleware.PoisonedTopicKey))
	var hist []poison.HistoryEntry
	require.NoError(t, json.Unmarshal([]byte(md.Get(poison.MetadataReasonHistory)), &hist))
	require.Len(t, hist, 1)
	require.Contains(t, hist[0].Reason, "unknown product P-new")
	require.Equal(t, f.main, hist[0].Topic)
	require.False(t, hist[0].ReplayedAt.IsZero())
}

// Rate limits the publishes: the k-th replayed message is published no
// sooner than k intervals after the first. Limit stops after that many
// matches.
func TestReplayRateAndLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	broker := kafkatest.Start(t)
	poisonTopic := broker.Topic(t, "poison", 1)
	target := broker.Topic(t, "target", 1)
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	for i := range 5 {
		m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, target)
		m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "boom")
		require.NoError(t, pub.Publish(poisonTopic, m))
	}
	rec := &timedPublisher{Publisher: pub}
	const rate = 20.0 // 50 ms apart
	res, err := poison.Replay(ctx, poison.Config{Kafka: idemkafka.ClientConfig{Brokers: broker.Addrs}, Topic: poisonTopic,
		Publisher: rec, Rate: rate, Limit: 4}, nil)
	require.NoError(t, err)
	require.Equal(t, 4, res.Matched)
	require.Equal(t, 4, res.Replayed)
	require.Equal(t, 4, res.Scanned, "Limit stops the read")
	require.Len(t, rec.at, 4)
	for k := 1; k < len(rec.at); k++ {
		require.GreaterOrEqual(t, rec.at[k].Sub(rec.at[0]), time.Duration(k)*time.Second/rate, "publish %d", k)
	}
	require.Equal(t, int64(4), endOffsets(t, broker.Addrs, target)[0])

	// An empty topic reads to its end at once; a bad config is refused.
	empty := broker.Topic(t, "empty", 2)
	res, err = poison.List(ctx, poison.Config{Kafka: idemkafka.ClientConfig{Brokers: broker.Addrs}, Topic: empty}, nil)
	require.NoError(t, err)
	require.Zero(t, res.Scanned)
	_, err = poison.Replay(ctx, poison.Config{Kafka: idemkafka.ClientConfig{Brokers: broker.Addrs}, Topic: empty}, nil)
	require.ErrorContains(t, err, "poison: invalid config: Publisher: required unless DryRun")
	_, err = poison.List(ctx, poison.Config{Topic: empty}, nil)
	require.ErrorContains(t, err, "Kafka.Brokers: required")
}

// timedPublisher records when each Publish started.
type timedPublisher struct {
	message.Publisher
	at []time.Time
}

func (p *timedPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.at = append(p.at, time.Now())
	return p.Publisher.Publish(topic, msgs...)
}

// A publish failure stops the replay with ErrPublish and the Result so far.
func TestReplayStopsOnPublishError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	broker := kafkatest.Start(t)
	poisonTopic := broker.Topic(t, "poison", 1)
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, nil)
	require.NoError(t, err)
	for range 2 {
		m := message.NewMessage(uuid.NewString(), nil)
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, "somewhere")
		require.NoError(t, pub.Publish(poisonTopic, m))
	}
	require.NoError(t, pub.Close()) // a closed publisher refuses to publish
	res, err := poison.Replay(ctx, poison.Config{Kafka: idemkafka.ClientConfig{Brokers: broker.Addrs}, Topic: poisonTopic, Publisher: pub}, nil)
	require.ErrorIs(t, err, poison.ErrPublish)
	require.Equal(t, 1, res.Matched)
	require.Zero(t, res.Replayed)
	require.False(t, errors.Is(err, poison.ErrIncompleteRead))
}

func eventually(t *testing.T, cond func() bool, what string) {
	t.Helper()
	require.Eventually(t, cond, 90*time.Second, 20*time.Millisecond, what)
}
