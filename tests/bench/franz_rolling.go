package bench

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("rolling-restart-franz", franzRollingRestart) }

// franzRollSettle is the wait after each instance is started again: the
// franz-go subscriber has no partition count to wait on (the Sarama
// section waits for balance), so each restart gets a fixed time.
const franzRollSettle = 6 * time.Second

// franzRollStart starts one instance of the rolling-restart workload on the
// franz-go subscriber with protocol ("classic": cooperative-sticky;
// "consumer": KIP-848); stop closes it.
func (r *parRig) franzRollStart(ctx context.Context, topic, group, protocol string, applied *atomic.Int64) (stop func(), err error) {
	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: r.brokers, ConsumerGroup: group, GroupProtocol: protocol,
		MaxInFlight: rollInFlight, ClientOpts: []kgo.Opt{kgo.FetchMaxWait(500 * time.Millisecond)}}, nil)
	if err != nil {
		return nil, err
	}
	d, err := idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: group, Table: r.table, Concurrency: sub.MaxInFlight()}, nil)
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return nil, err
		}
		t := time.NewTimer(rollCall)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		applied.Add(1)
		return nil, nil
	})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	router.AddConsumerHandler(group, topic, sub, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	ran := make(chan error, 1)
	go func() { ran <- router.Run(ctx) }()
	<-router.Running()
	return func() {
		_ = router.Close()
		<-ran
		_ = sub.Close()
	}, nil
}

// franzRollRun is rollRun on the franz-go subscriber: the steady rate
// (median 1-s rate) and the lowest 1-s rate from the first restart to
// franzRollSettle after the last.
func (r *parRig) franzRollRun(ctx context.Context, topic, protocol string) (steady, lowest float64, err error) {
	group := fmt.Sprintf("bench-froll-%d", r.seq.Add(1))
	var applied atomic.Int64
	stops := make([]func(), 0, rollInstances)
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	for range rollInstances {
		stop, err := r.franzRollStart(ctx, topic, group, protocol, &applied)
		if err != nil {
			return 0, 0, err
		}
		stops = append(stops, stop)
	}
	time.Sleep(franzRollSettle)
	rates := sampleRates(&applied)
	time.Sleep(rollSteady)
	steadyRates := rates.take()
	for i := range stops {
		stops[i]()
		stop, err := r.franzRollStart(ctx, topic, group, protocol, &applied)
		if err != nil {
			stops = slices.Delete(stops, i, i+1)
			return 0, 0, err
		}
		stops[i] = stop
		time.Sleep(franzRollSettle)
	}
	during := rates.take()
	rates.stop()
	if len(steadyRates) == 0 || len(during) == 0 {
		return 0, 0, fmt.Errorf("bench: rolling restart (franz-go): no samples")
	}
	r.o.Logf("    franz-go %s, 1-s rates: steady %v, during the restarts %v", protocol, steadyRates, during)
	return Summarise(steadyRates).Median, slices.Min(during), nil
}

// franzRollingRestart compares KIP-848 with cooperative-sticky on the
// franz-go subscriber, on the rolling-restart section's workload.
func franzRollingRestart(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	rounds := max(o.Rounds/2, 1)
	if o.Short {
		rounds = 1
	}
	topic := fmt.Sprintf("bench-froll-%d", r.seq.Add(1))
	if err := kafkatest.CreateTopic(r.brokers, topic, rollPartitions); err != nil {
		return Section{}, err
	}
	capacity := float64(rollInstances*rollInFlight) / rollCall.Seconds()
	backlog := int(capacity * 80)
	if err := r.produce(topic, backlog, 0); err != nil {
		return Section{}, err
	}
	type result struct{ steady, lowest, ratio []float64 }
	res := map[string]*result{"classic": {}, "consumer": {}}
	run := func(protocol string) func() (float64, error) {
		return func() (float64, error) {
			steady, lowest, err := r.franzRollRun(ctx, topic, protocol)
			if err != nil {
				return 0, err
			}
			x := res[protocol]
			x.steady, x.lowest, x.ratio = append(x.steady, steady), append(x.lowest, lowest), append(x.ratio, lowest/steady)
			return lowest / steady, nil
		}
	}
	if _, err := Rotate(rounds, run("classic"), run("consumer")); err != nil {
		return Section{}, err
	}
	k, c := Summarise(res["consumer"].lowest), Summarise(res["classic"].lowest)
	ratio := Summarise(pairRatios(res["classic"].lowest, res["consumer"].lowest))
	var rows [][]string
	for _, p := range []string{"consumer", "classic"} {
		x, name, target := res[p], "classic, cooperative-sticky", "–"
		if p == "consumer" {
			name = "KIP-848 (GroupProtocol \"consumer\")"
			target = fmt.Sprintf("lowest ≥ 1× cooperative-sticky's: %s (%s)", pass(ratio.Median >= 1), ratio)
		}
		rows = append(rows, []string{name, fmtRate(x.steady), fmtRate(x.lowest), Summarise(x.ratio).String(), target})
	}
	o.Logf("  rolling restart (franz-go): lowest 1-s KIP-848 %.0f, cooperative-sticky %.0f msg/s, ratio %s", k.Median, c.Median, ratio)
	var b strings.Builder
	b.WriteString(Table([]string{"group protocol", "steady msg/s (median)", "lowest 1-s msg/s (median)", "lowest / steady", "target"}, rows))
	fmt.Fprintf(&b, "\nThe rolling-restart section's workload (%d instances, MaxInFlight %d, %d partitions, a %s wait in the transaction) on "+
		"the franz-go subscriber; each instance in turn is closed and a new one started, the next %s later (no balance to wait on). "+
		"%d round(s), the two protocols alternated, each run a new consumer group.\n",
		rollInstances, rollInFlight, rollPartitions, rollCall, franzRollSettle, rounds)
	return Section{Title: "Rolling restart (idemkafka/franz): KIP-848 against cooperative-sticky", Markdown: b.String()}, nil
}
