package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("forwarder", forwarderThroughput) }

const (
	fwdPartitions = 4
	fwdAggregates = 50
	fwdBatch      = 1000 // outbox.ForwarderConfig.BatchSize's default
	// fwdBatchesPerTx is outbox.ForwarderConfig.BatchesPerTransaction's default.
	fwdBatchesPerTx = 4
)

// fwdRig holds the broker, the database and the producers shared by the
// rounds; every measurement gets a fresh outbox table and Kafka topic with
// the same n messages.
type fwdRig struct {
	brokers  []string
	db       *DB
	outbox   *outbox.Outbox
	producer sarama.SyncProducer // the idempotent producer (baseline and relay)
	txn      sarama.SyncProducer // the same, transactional (one Kafka transaction per batch)
	wmPub    *kafka.Publisher    // watermill-kafka with the same Sarama settings
	n        int
	seq      atomic.Int64
	closers  []func() // run in reverse order by close
}

func (r *fwdRig) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
}

func newFwdRig(ctx context.Context, o Options, n int) (*fwdRig, error) {
	r := &fwdRig{brokers: o.Brokers, n: n}
	if len(r.brokers) == 0 {
		c, err := kafkatest.NewFake()
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		r.brokers = c.ListenAddrs()
		r.closers = append(r.closers, c.Close)
	}
	fail := func(err error) (*fwdRig, error) { r.close(); return nil, err }
	db, err := NewDB(ctx, o, "fwd", 8, nil)
	if err != nil {
		return fail(err)
	}
	r.db = db
	r.closers = append(r.closers, db.Close)
	if r.outbox, err = outbox.New(outbox.Config{Schema: db.Schema}, nil); err != nil {
		return fail(err)
	}
	kc := idemkafka.ClientConfig{Brokers: r.brokers}
	if r.producer, err = idemkafka.NewSyncProducer(kc); err != nil {
		return fail(err)
	}
	r.closers = append(r.closers, func() { _ = r.producer.Close() })
	tc := kc
	tc.TransactionalID = "bench-forwarder-" + uuid.NewString()
	if r.txn, err = idemkafka.NewSyncProducer(tc); err != nil {
		return fail(err)
	}
	r.closers = append(r.closers, func() { _ = r.txn.Close() })
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	if err != nil {
		return fail(err)
	}
	if r.wmPub, err = kafka.NewPublisher(pc, watermill.NopLogger{}); err != nil {
		return fail(err)
	}
	r.closers = append(r.closers, func() { _ = r.wmPub.Close() })
	return r, nil
}

func (r *fwdRig) messages() []*message.Message {
	msgs := make([]*message.Message, r.n)
	for i := range msgs {
		key := fmt.Sprintf("aggregate-%02d", i%fwdAggregates)
		m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"orderId":%q,"seq":%d,"amount":%d,"currency":"EUR","note":"benchmark event of about one hundred and fifty bytes"}`, key, i/fwdAggregates, 1000+i)))
		msgs[i] = publisher.WithPartitionKey(m, key)
	}
	return msgs
}

// migrateTopic creates the outbox tables of topic, a topic o's Config does
// not list (the benchmarks make a fresh one per round).
func migrateTopic(ctx context.Context, db migrate.Beginner, o *outbox.Outbox, topic string) error {
	cfg := o.Config()
	cfg.Topics = []string{topic}
	return migrate.Up(ctx, db, outbox.MigrationLine(cfg, topic))
}

// fill creates a Kafka topic and an outbox table holding n committed rows,
// and returns the topic.
func (r *fwdRig) fill(ctx context.Context) (string, error) {
	topic := fmt.Sprintf("bench-fwd-%d-%s", r.seq.Add(1), uuid.NewString()[:8])
	if err := kafkatest.CreateTopic(r.brokers, topic, fwdPartitions); err != nil {
		return "", err
	}
	if err := migrateTopic(ctx, r.db.Pool, r.outbox, topic); err != nil {
		return "", err
	}
	msgs := r.messages()
	pub := r.outbox.PoolPublisher(r.db.Pool)
	for i := 0; i < len(msgs); i += 1000 {
		if err := pub.Publish(topic, msgs[i:min(i+1000, len(msgs))]...); err != nil {
			return "", err
		}
	}
	return topic, nil
}

// raw sends the same n stamped messages straight from memory through the
// idempotent SyncProducer, in SendMessages calls of batch messages (batch
// >= n: one call, Sarama pipelines them: the producer's own ceiling).
func (r *fwdRig) raw(ctx context.Context, batch int) (float64, error) {
	topic := fmt.Sprintf("bench-raw-%d-%s", r.seq.Add(1), uuid.NewString()[:8])
	if err := kafkatest.CreateTopic(r.brokers, topic, fwdPartitions); err != nil {
		return 0, err
	}
	msgs := r.messages()
	pms := make([]*sarama.ProducerMessage, len(msgs))
	for i, m := range msgs {
		if _, err := publisher.Stamp(ctx, m); err != nil {
			return 0, err
		}
		pm, err := idemkafka.Marshaler{}.Marshal(topic, m)
		if err != nil {
			return 0, err
		}
		pms[i] = pm
	}
	start := time.Now()
	for i := 0; i < len(pms); i += batch {
		if err := r.producer.SendMessages(pms[i:min(i+batch, len(pms))]); err != nil {
			return 0, err
		}
	}
	return float64(r.n) / time.Since(start).Seconds(), nil
}

// relay measures the outbox Forwarder (fast path: SyncProducer.SendMessages
// per batch), or with pub set, the Forwarder handing each batch to a
// Watermill publisher, as it runs in a service: already started on the
// topic (tables checked, position registered, statements prepared by its
// first reads of an empty table), it forwards n rows that one transaction
// makes visible at once. The rate runs from that COMMIT to the last
// acknowledgement.
func (r *fwdRig) relay(ctx context.Context, pub message.Publisher, prod sarama.SyncProducer) (float64, error) {
	topic := fmt.Sprintf("bench-fwd-%d-%s", r.seq.Add(1), uuid.NewString()[:8])
	if err := kafkatest.CreateTopic(r.brokers, topic, fwdPartitions); err != nil {
		return 0, err
	}
	if err := migrateTopic(ctx, r.db.Pool, r.outbox, topic); err != nil {
		return 0, err
	}
	cfg := outbox.ForwarderConfig{DB: r.db.Pool, Outbox: r.outbox, Topics: []string{topic}, PollInterval: time.Millisecond}
	if pub != nil {
		cfg.Publisher = pub
	} else {
		cfg.Producer = prod
	}
	f, err := outbox.NewForwarder(cfg, nil)
	if err != nil {
		return 0, err
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { _ = f.Close() }()
	// Warm: a first row forwarded (every statement of a transaction run
	// once), then the n rows in one transaction.
	if err := r.outbox.PoolPublisher(r.db.Pool).Publish(topic, r.messages()[0]); err != nil {
		return 0, err
	}
	wait := func(k uint64) error {
		for f.Stats().Forwarded < k {
			select {
			case err := <-done:
				return fmt.Errorf("forwarder stopped: %v", err)
			case <-time.After(100 * time.Microsecond):
			}
		}
		return nil
	}
	if err := wait(1); err != nil {
		return 0, err
	}
	tx, err := r.db.Pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	msgs := r.messages()
	for i := 0; i < len(msgs); i += 1000 {
		if err := r.outbox.Publisher(tx).Publish(topic, msgs[i:min(i+1000, len(msgs))]...); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	if err := wait(uint64(r.n) + 1); err != nil {
		return 0, err
	}
	elapsed := time.Since(start)
	_ = f.Close()
	if err := <-done; err != nil {
		return 0, err
	}
	return float64(r.n) / elapsed.Seconds(), nil
}

// watermill drains a filled table the stock way: a watermill-sql v4
// Subscriber on the same table hands out one row at a time, each published
// with the watermill-kafka publisher (same Sarama settings) and acked.
func (r *fwdRig) watermill(ctx context.Context) (float64, error) {
	topic, err := r.fill(ctx)
	if err != nil {
		return 0, err
	}
	// The outbox tables are watermill-sql v4's: its subscriber reads them
	// through adapters naming them.
	schema := wsql.DefaultPostgreSQLSchema{GenerateMessagesTableName: r.outbox.MessagesTable, SubscribeBatchSize: fwdBatch}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(r.db.Pool), wsql.SubscriberConfig{
		ConsumerGroup: "watermill-forwarder",
		SchemaAdapter: &schema,
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string {
			return outboxsql.TopicTables(r.outbox.Config().Schema, r.outbox.Config().TablePrefix, topic).Offsets
		}},
		PollInterval: time.Millisecond,
	}, nil)
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	ch, err := sub.Subscribe(sctx, topic)
	if err != nil {
		return 0, err
	}
	for i := 0; i < r.n; i++ {
		msg, ok := <-ch
		if !ok {
			return 0, errors.New("subscriber closed early")
		}
		if err := r.wmPub.Publish(topic, msg); err != nil {
			msg.Nack()
			return 0, err
		}
		msg.Ack()
	}
	return float64(r.n) / time.Since(start).Seconds(), nil
}

func forwarderThroughput(ctx context.Context, o Options) (Section, error) {
	n, rounds := 20000, o.Rounds
	if o.Short {
		n = 4000
	}
	if rounds < 1 {
		rounds = 1
	}
	r, err := newFwdRig(ctx, o, n)
	if err != nil {
		return Section{}, err
	}
	defer r.close()

	// The fast subjects (the two raw baselines and the batching relay)
	// drain n messages in a few hundred milliseconds, where one scheduling
	// hiccup of a shared machine moves a ratio by half: each round runs
	// them fastReps times, interleaved, and every repetition gives a ratio
	// against its own baselines. The slow ones run once per round.
	fastReps := 3
	if o.Short {
		fastReps = 1
	}
	subjects := fwdSubjects(r, n)
	fr := newFwdRates(len(subjects))
	for round := 0; round < rounds; round++ {
		for rep := 0; rep < fastReps; rep++ {
			got, err := fwdRepetition(ctx, subjects, round, rep)
			if err != nil {
				return Section{}, err
			}
			fr.add(got)
			o.Logf("bench: forwarder round %d.%d: %v msg/s", round+1, rep+1, got)
		}
	}
	var rows [][]string
	for i, s := range subjects {
		rs := Summarise(fr.rates[i])
		rows = append(rows, []string{s.name, fmt.Sprintf("%.0f (%.0f–%.0f)", rs.Median, rs.Min, rs.Max), Summarise(fr.ratios[i]).String(), Summarise(fr.ratiosBatched[i]).String(), Summarise(fr.ratiosRelay[i]).String()})
	}
	return Section{Title: "Outbox forwarder vs raw idempotent producer", Markdown: fwdMarkdown(o, n, rounds, fastReps, rows)}, nil
}

// fwdSubject is one path measured by the forwarder section: run sends the
// rig's messages and returns its rate; a fast one runs several times a round.
type fwdSubject struct {
	name string
	fast bool
	run  func(context.Context) (float64, error)
}

// fwdRelay is the index of the batching relay among fwdSubjects: the last
// column's baseline.
const fwdRelay = 4

// fwdSubjects are the paths compared, n messages each: the two raw
// baselines first.
func fwdSubjects(r *fwdRig, n int) []fwdSubject {
	return []fwdSubject{
		{"raw idempotent Sarama SyncProducer, one SendMessages call (baseline)", true, func(ctx context.Context) (float64, error) { return r.raw(ctx, n) }},
		{fmt.Sprintf("raw idempotent Sarama SyncProducer, SendMessages per %d (the relay's batch)", fwdBatch), true, func(ctx context.Context) (float64, error) { return r.raw(ctx, fwdBatch) }},
		{"watermill-sql Subscriber → watermill-kafka Publisher, one message at a time", false, r.watermill},
		{"outbox.Forwarder, Publisher = watermill-kafka (batched reads, one send per message)", false, func(ctx context.Context) (float64, error) { return r.relay(ctx, r.wmPub, nil) }},
		{"outbox.Forwarder, Producer = SyncProducer (batching relay, SendMessages per batch)", true, func(ctx context.Context) (float64, error) { return r.relay(ctx, nil, r.producer) }},
		{"outbox.Forwarder, Producer = transactional SyncProducer (one Kafka transaction per batch)", true, func(ctx context.Context) (float64, error) { return r.relay(ctx, nil, r.txn) }},
	}
}

// fwdRepetition runs each subject once (after the first repetition of a
// round, the fast ones only), in an order rotated by round and rep, and
// returns their rates (0: not run).
func fwdRepetition(ctx context.Context, subjects []fwdSubject, round, rep int) ([]float64, error) {
	got := make([]float64, len(subjects))
	for k := range subjects {
		i := (k + round + rep) % len(subjects) // rotate the order
		if !subjects[i].fast && rep > 0 {
			continue
		}
		rate, err := subjects[i].run(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", subjects[i].name, err)
		}
		got[i] = rate
	}
	return got, nil
}

// fwdRates are each subject's rates and its ratios to the baselines and
// to the batching relay, of the same repetition.
type fwdRates struct {
	rates, ratios, ratiosBatched, ratiosRelay [][]float64
}

func newFwdRates(n int) *fwdRates {
	return &fwdRates{rates: make([][]float64, n), ratios: make([][]float64, n), ratiosBatched: make([][]float64, n), ratiosRelay: make([][]float64, n)}
}

// add records one repetition's rates (0: not run).
func (fr *fwdRates) add(got []float64) {
	for i := range got {
		if got[i] == 0 {
			continue
		}
		fr.rates[i] = append(fr.rates[i], got[i])
		fr.ratios[i] = append(fr.ratios[i], got[i]/got[0])
		fr.ratiosBatched[i] = append(fr.ratiosBatched[i], got[i]/got[1])
		if got[fwdRelay] != 0 {
			fr.ratiosRelay[i] = append(fr.ratiosRelay[i], got[i]/got[fwdRelay])
		}
	}
}

// fwdMarkdown is the section's text: its table and what it measures.
func fwdMarkdown(o Options, n, rounds, fastReps int, rows [][]string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d messages (~150 B, %d aggregates as keys, %d partitions) sent to Kafka (%s) with the idempotent producer "+
		"(acks=all, MaxOpenRequests=1). The baselines send them, stamped and marshalled beforehand, straight from memory. The "+
		"outbox.Forwarder rows are the relay as it runs in a service: started on the topic and warm (its first row forwarded), it "+
		"forwards the messages that one transaction makes visible at once, timed from that COMMIT to the last acknowledgement. "+
		"The watermill-sql row drains a table filled beforehand, timed from its Subscribe call. The Forwarder runs with its defaults (BatchSize %d, BatchesPerTransaction %d); the watermill-sql "+
		"subscriber reads %d rows per query. %d rounds, order rotated each time; in each round the two raw baselines and the batching relay run %d times, "+
		"interleaved, the watermill-sql and Publisher rows once; ratio = subject / baseline of the same repetition. "+
		"The one-call baseline is the producer's ceiling; the batched one is what any relay sending batches of that size synchronously could reach. "+
		"The transactional row sends each batch as one Kafka transaction (idemkafka.ClientConfig.TransactionalID), which keeps a key's order "+
		"through a partial send failure; its last column is what that costs against the batching relay.\n\n",
		n, fwdAggregates, fwdPartitions, kafkaDesc(o.Brokers), fwdBatch, fwdBatchesPerTx, fwdBatch, rounds, fastReps)
	b.WriteString(Table([]string{"path", "msg/s median (min–max)", "ratio to raw producer (one call)", "ratio to raw producer (batched)", "ratio to the batching relay"}, rows))
	return b.String()
}
