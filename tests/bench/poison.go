package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("poison", poisonRow) }

const (
	poisonKeys = 20  // keys of the other rows
	poisonRate = 400 // rows/s written, one per transaction
	poisonKey  = "poison"
	// poisonEvery: every poisonEvery-th row is the poisoned key's, which
	// waits in the dead table behind its poison row.
	poisonEvery = 100
)

// poisonResult is one paced run: the publish→Kafka latencies of the other
// keys' rows, the records of them on the topic (copies included), and the
// rows left in the dead table.
type poisonResult struct {
	lat           []time.Duration
	others, sent  int
	distinct      int
	dead          int64
	quarantined   uint64
	forwarderErrs uint64
}

// poisonRun writes n rows at poisonRate, one per transaction, through a
// running forwarder with its defaults, and times each row of the other
// keys from its publish to its arrival at a consumer of the topic. With
// poison, the topic's first row is one byte over the producer's limit
// (written past Publish's own check, as another writer would), of key
// "poison", and every poisonEvery-th row afterwards is of that key too.
func (r *fwdRig) poisonRun(ctx context.Context, n int, poison bool) (poisonResult, error) {
	var res poisonResult
	topic := fmt.Sprintf("bench-poison-%d-%s", r.seq.Add(1), uuid.NewString()[:8])
	if err := kafkatest.CreateTopic(r.brokers, topic, fwdPartitions); err != nil {
		return res, err
	}
	if err := migrateTopic(ctx, r.db.Pool, r.outbox, topic); err != nil {
		return res, err
	}
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: r.db.Pool, Outbox: r.outbox, Producer: r.producer, Topics: []string{topic}}, nil)
	if err != nil {
		return res, err
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { _ = f.Close(); <-done }()

	c, err := sarama.NewConsumer(r.brokers, idemkafka.SaramaConsumerConfig(nil))
	if err != nil {
		return res, err
	}
	defer c.Close()
	pr := &poisonReader{res: &res, ids: map[string]bool{}, stop: make(chan struct{})}
	if err := pr.start(c, topic); err != nil {
		return res, err
	}
	defer pr.close()

	if poison {
		if err := r.insertPoison(ctx, topic); err != nil {
			return res, err
		}
	}
	if err := r.publishPoisonRun(topic, n, poison, &res); err != nil {
		return res, err
	}
	if err := pr.waitForOthers(time.Minute); err != nil {
		return res, err
	}
	b, err := r.outbox.Backlog(ctx, r.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	if err != nil {
		return res, err
	}
	res.dead = b[0].Dead
	st := f.Stats()
	res.quarantined, res.forwarderErrs = st.Quarantined, st.Errors
	pr.mu.Lock()
	defer pr.mu.Unlock()
	res.distinct = len(pr.ids)
	return res, nil
}

// poisonReader consumes every partition of a poison run's topic from the
// start, each record's arrival against the publish time in its payload.
type poisonReader struct {
	mu   sync.Mutex
	res  *poisonResult // sent and lat, under mu
	ids  map[string]bool
	stop chan struct{}
	wg   sync.WaitGroup
}

// start consumes topic's partitions on c until close.
func (pr *poisonReader) start(c sarama.Consumer, topic string) error {
	for p := range int32(fwdPartitions) {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			pr.close()
			return err
		}
		pr.wg.Go(func() {
			defer pc.Close()
			for {
				select {
				case <-pr.stop:
					return
				case m := <-pc.Messages():
					pr.got(m, time.Now())
				}
			}
		})
	}
	return nil
}

// got counts m, arrived at at.
func (pr *poisonReader) got(m *sarama.ConsumerMessage, at time.Time) {
	var body struct {
		Key string `json:"key"`
		At  int64  `json:"at"`
	}
	_ = json.Unmarshal(m.Value, &body)
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.res.sent++
	if body.Key != poisonKey {
		pr.res.lat = append(pr.res.lat, at.Sub(time.Unix(0, body.At)))
		pr.ids[string(m.Value)] = true
	}
}

// waitForOthers waits until every row of the other keys reached Kafka, at
// most d.
func (pr *poisonReader) waitForOthers(d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		pr.mu.Lock()
		got := len(pr.res.lat)
		pr.mu.Unlock()
		if got >= pr.res.others {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d rows of the other keys reached Kafka within a minute", got, pr.res.others)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (pr *poisonReader) close() { close(pr.stop); pr.wg.Wait() }

// insertPoison writes the poison row to topic's outbox: larger than the
// broker accepts, under poisonKey.
func (r *fwdRig) insertPoison(ctx context.Context, topic string) error {
	big := fmt.Sprintf(`{"key":%q,"pad":"%s"}`, poisonKey, strings.Repeat("x", sarama.NewConfig().Producer.MaxMessageBytes))
	_, err := r.db.Pool.Exec(ctx, `INSERT INTO `+r.outbox.MessagesTable(topic)+` (uuid, payload, metadata, transaction_id)
			VALUES ($1, $2, $3, pg_current_xact_id())`, uuid.NewString(), []byte(big), []byte(`{"partition_key":"`+poisonKey+`"}`))
	return err
}

// publishPoisonRun publishes n rows to topic at poisonRate, one per
// transaction, every poisonEvery-th under poisonKey when poison is set;
// it counts the others in res.
func (r *fwdRig) publishPoisonRun(topic string, n int, poison bool, res *poisonResult) error {
	pub := r.outbox.PoolPublisher(r.db.Pool)
	tick := time.NewTicker(time.Second / poisonRate)
	defer tick.Stop()
	for i := range n {
		<-tick.C
		key := fmt.Sprintf("key-%02d", i%poisonKeys)
		if poison && i%poisonEvery == poisonEvery-1 {
			key = poisonKey
		} else {
			res.others++
		}
		m := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"key":%q,"seq":%d,"at":%d}`, key, i, time.Now().UnixNano()))
		if err := pub.Publish(topic, publisher.WithPartitionKey(m, key)); err != nil {
			return err
		}
	}
	return nil
}

func poisonRow(ctx context.Context, o Options) (Section, error) {
	n, rounds := 4000, o.Rounds
	if o.Short {
		n = 800
	}
	rounds = max(rounds, 1)
	r, err := newFwdRig(ctx, o, 0)
	if err != nil {
		return Section{}, err
	}
	defer r.close()

	var (
		p99Clean, p99Poison, p50Clean, p50Poison, ratios []float64
		copies, deadRows, errs                           int64
		quarantined                                      uint64
	)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	for round := range rounds {
		var clean, pois poisonResult
		for k := range 2 {
			withPoison := (k+round)%2 == 1 // alternate which runs first
			res, err := r.poisonRun(ctx, n, withPoison)
			if err != nil {
				return Section{}, fmt.Errorf("poison=%v: %w", withPoison, err)
			}
			if withPoison {
				pois = res
			} else {
				clean = res
			}
		}
		c99, q99 := percentile(clean.lat, 0.99), percentile(pois.lat, 0.99)
		p99Clean, p99Poison = append(p99Clean, ms(c99)), append(p99Poison, ms(q99))
		p50Clean, p50Poison = append(p50Clean, ms(percentile(clean.lat, 0.5))), append(p50Poison, ms(percentile(pois.lat, 0.5)))
		ratios = append(ratios, float64(q99)/float64(c99))
		copies += int64(len(pois.lat)-pois.distinct) + int64(len(clean.lat)-clean.distinct)
		deadRows += pois.dead
		quarantined += pois.quarantined
		errs += int64(pois.forwarderErrs)
		o.Logf("bench: poison round %d: other keys' publish→Kafka p99 %s clean, %s with a poison row; dead rows %d, quarantined %d, copies %d",
			round+1, c99, q99, pois.dead, pois.quarantined, len(pois.lat)-pois.distinct)
	}
	dur := func(xs []float64) string {
		s := Summarise(xs)
		return fmt.Sprintf("%.1f ms (%.1f–%.1f)", s.Median, s.Min, s.Max)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d rows written at %d rows/s, one per transaction, over %d keys and %d partitions, through a running outbox.Forwarder "+
		"(defaults; idempotent producer; %s). With a poison row, the topic's first row is one byte over the producer's 1 MiB limit, of key %q "+
		"(written past Publish's own check, as another writer would), and every %dth row afterwards is of that key: the forwarder moves the "+
		"poison row to the dead table, holds the key's later rows behind it there, and sends the rest. Latency runs from the publish call to "+
		"the record's arrival at a consumer of the topic, for the rows of the other keys. %d rounds; in each, the clean topic and the "+
		"poisoned one run one after the other (order alternated); ratio = poisoned p99 / clean p99 of the same round.\n\n",
		n, poisonRate, poisonKeys, fwdPartitions, kafkaDesc(o.Brokers), poisonKey, poisonEvery, rounds)
	b.WriteString(Table([]string{"topic", "other keys' p50", "other keys' p99", "p99 ratio to the clean topic"}, [][]string{
		{"clean", dur(p50Clean), dur(p99Clean), "1.00 (1.00–1.00)"},
		{"one poison row", dur(p50Poison), dur(p99Poison), Summarise(ratios).String()},
	}))
	fmt.Fprintf(&b, "\nOver the poisoned runs: %d rows in the dead tables (the poison rows and the %d rows per run of their key held behind them), "+
		"%d moved there by the forwarder, %d failed forwarder transactions, %d copies of other keys' rows on the topics.\n",
		deadRows, n/poisonEvery, quarantined, errs, copies)
	return Section{Title: "Outbox poison row: the other keys' latency", Markdown: b.String()}, nil
}
