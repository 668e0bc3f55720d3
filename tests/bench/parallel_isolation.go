package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("hol-isolation", holIsolation) }

// The workload of the head-of-line section: one key takes 1% of the
// records (every hundredth), on top of the same records of the other keys.
const (
	holKey      = "hol-key"
	holEvery    = 100
	holSlowCall = 300 * time.Millisecond
)

// holProduce publishes others records keyed key-(i mod parKeys) and, when
// withKey, one record of holKey before each holEvery-th of them.
func (r *parRig) holProduce(topic string, others int, withKey bool) error {
	p, err := sarama.NewSyncProducer(r.brokers, idemkafka.SaramaProducerConfig(nil))
	if err != nil {
		return err
	}
	defer p.Close()
	m := idemkafka.Marshaler{}
	var batch []*sarama.ProducerMessage
	add := func(key string) error {
		id := uuid.Must(uuid.NewV7())
		msg := message.NewMessage(id.String(), []byte(`{"amount":42}`))
		msg.Metadata.Set(publisher.MetadataEventID, id.String())
		publisher.WithPartitionKey(msg, key)
		pm, err := m.Marshal(topic, msg)
		if err != nil {
			return err
		}
		batch = append(batch, pm)
		if len(batch) == 500 {
			err = p.SendMessages(batch)
			batch = batch[:0]
		}
		return err
	}
	for i := range others {
		if withKey && i%holEvery == 0 {
			if err := add(holKey); err != nil {
				return err
			}
		}
		if err := add("key-" + strconv.Itoa(i%parKeys)); err != nil {
			return err
		}
	}
	if len(batch) > 0 {
		return p.SendMessages(batch)
	}
	return nil
}

// errHolFails is the failure of the failing key's handler.
var errHolFails = errors.New("bench: this key always fails")

// holRun consumes topic with the parallel subscriber behind the dedup
// middleware (one transaction per message, a business row each) until the
// others records of the other keys are committed, and returns their rate
// (first handled to the others-th committed). holKey's records wait
// holSlowCall in their transaction (slow) or fail (!slow).
func (r *parRig) holRun(ctx context.Context, topic string, others int, slow bool) (float64, error) {
	group := fmt.Sprintf("bench-hol-%d", r.seq.Add(1))
	logger := watermill.NopLogger{}
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: r.brokers}, ConsumerGroup: group, MaxInFlight: parMaxInFlight}, logger)
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	d, err := idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: group, Table: r.table, Concurrency: sub.MaxInFlight()}, nil)
	if err != nil {
		return 0, err
	}
	done := newSpan(others)
	var first atomic.Int64
	mw := d.Middleware(holHandler(slow))
	var unexpected atomic.Pointer[error]
	failed := make(chan struct{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return 0, err
	}
	router.AddConsumerHandler(group, topic, sub, func(msg *message.Message) error {
		first.CompareAndSwap(0, time.Now().UnixNano())
		_, err := mw(msg)
		key, _ := kafka.MessageKeyFromCtx(msg.Context())
		switch {
		case string(key) == holKey:
			return err
		case err != nil:
			select {
			case <-done.done: // stopping
			default:
				if unexpected.CompareAndSwap(nil, &err) {
					close(failed)
				}
			}
			return err
		}
		if done.count.Load() < done.n {
			done.mark()
		}
		return nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	var timeout error
	select {
	case <-done.done:
	case <-failed:
	case err := <-runErr:
		return 0, err
	case <-time.After(e2eRoundTimeout):
		timeout = fmt.Errorf("bench: head-of-line: %d of %d events in %s", done.count.Load(), others, e2eRoundTimeout)
	}
	_ = router.Close()
	<-runErr
	if p := unexpected.Load(); p != nil {
		return 0, *p
	}
	if timeout != nil {
		return 0, timeout
	}
	// From the first record handled, the hot key's included.
	return float64(others) / time.Duration(done.last.Load()-first.Load()).Seconds(), nil
}

// holHandler is the head-of-line run's business handler: a business row
// each; holKey's records then wait holSlowCall in their transaction (slow)
// or fail (!slow).
func holHandler(slow bool) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return nil, err
		}
		if key, _ := kafka.MessageKeyFromCtx(ctx); string(key) == holKey {
			if !slow {
				return nil, errHolFails
			}
			t := time.NewTimer(holSlowCall)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return nil, nil
	}
}

func holIsolation(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	if err := r.warm(ctx); err != nil {
		return Section{}, err
	}
	rounds, others := o.Rounds, 8000
	if o.Short {
		rounds, others = 2, 2000
	}
	clean, err := r.topic("bench-hol-clean")
	if err != nil {
		return Section{}, err
	}
	if err := r.holProduce(clean, others, false); err != nil {
		return Section{}, err
	}
	withKey, err := r.topic("bench-hol-key")
	if err != nil {
		return Section{}, err
	}
	if err := r.holProduce(withKey, others, true); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for _, w := range []struct {
		name string
		slow bool
	}{
		{fmt.Sprintf("one hot key (1%% of the records), its handler waits %s", holSlowCall), true},
		{"one key failing forever (1% of the records), no retry topic", false},
	} {
		rates, err := Rotate(rounds,
			func() (float64, error) { return r.holRun(ctx, clean, others, w.slow) },
			func() (float64, error) { return r.holRun(ctx, withKey, others, w.slow) })
		if err != nil {
			return Section{}, fmt.Errorf("%s: %w", w.name, err)
		}
		st := Summarise(Ratios(rates[0], rates[1]))
		o.Logf("  head-of-line, %s: %s msg/s, without it %s msg/s, ratio %s", w.name, fmtRate(rates[1]), fmtRate(rates[0]), st)
		rows = append(rows, []string{w.name, fmt.Sprint(others), fmtRate(rates[0]), fmtRate(rates[1]), st.String(),
			fmt.Sprintf("≥ 0.8×: %s", pass(st.Median >= 0.8))})
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workload", "other keys' events", "their msg/s without the key (median)", "their msg/s with it (median)", "ratio", "target"}, rows))
	fmt.Fprintf(&b, "\nKafka (%s, %d partitions) → watermill Router → dedup middleware (one transaction per message) → handler "+
		"(one business row); the parallel subscriber at MaxInFlight %d with its defaults (PartitionWindow 1024, NackResendSleep 100 ms), "+
		"pool of %d connections. A backlog of %d events of %d other keys (key-(i mod %d)), the same in both topics; the second topic "+
		"also has one record of one more key before every %dth of them (%d records, all on one partition). That key's handler "+
		"either waits %s in its transaction (hot: its %d records take %s one after the other) or always fails (no retry topic, "+
		"no poison queue: nacked and handed out again after NackResendSleep, its later records waiting behind it). Each run is a new "+
		"consumer group; its rate is the other keys' events from the first event handled to the last of the other keys' committed. "+
		"%d rounds, the two topics' order rotated each round; ratios are of the same round.\n",
		kafkaDesc(o.Brokers), parPartitions, parMaxInFlight, parPoolConns, others, parKeys, parKeys, holEvery, others/holEvery,
		holSlowCall, others/holEvery, time.Duration(others/holEvery)*holSlowCall, rounds)
	return Section{Title: "Head-of-line isolation (idemkafka): the other keys' rate with one hot or failing key", Markdown: b.String()}, nil
}
