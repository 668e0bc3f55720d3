package bench

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("rolling-restart", rollingRestart) }

// The workload of the rolling-restart section: 3 instances of the parallel
// subscriber on 12 partitions, each with MaxInFlight 8 and a handler that
// waits 50 ms in its transaction, so that the group's rate is set by its
// members (3 × 8 / 50 ms), not by the machine.
const (
	rollInstances  = 3
	rollPartitions = 12
	rollInFlight   = 8
	rollCall       = 50 * time.Millisecond
	rollSteady     = 8 * time.Second  // measured before the first restart
	rollSettle     = 3 * time.Second  // after each instance is back
	rollStable     = 90 * time.Second // the most a restart may take to settle
)

// rollInstance is one instance: a parallel subscriber behind the dedup
// middleware in a router.
type rollInstance struct {
	sub    *parallel.Subscriber
	router *message.Router
	ran    chan error
}

func (r *parRig) rollStart(ctx context.Context, topic, group string, coop bool, applied *atomic.Int64) (*rollInstance, error) {
	sc := sarama.NewConfig()
	if coop {
		sc.Version = sarama.V2_4_0_0
		sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	}
	logger := watermill.NopLogger{}
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client: idemkafka.ClientConfig{Brokers: r.brokers, Sarama: sc}, ConsumerGroup: group, MaxInFlight: rollInFlight,
	}, logger)
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
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	router.AddConsumerHandler(group, topic, sub, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	in := &rollInstance{sub: sub, router: router, ran: make(chan error, 1)}
	go func() { in.ran <- router.Run(ctx) }()
	<-router.Running()
	return in, nil
}

func (in *rollInstance) stop() {
	_ = in.router.Close()
	<-in.ran
	_ = in.sub.Close()
}

// rollBalanced reports whether every instance holds partitions and all of
// them are held.
func rollBalanced(ins []*rollInstance) bool {
	total := 0
	for _, in := range ins {
		n := len(in.sub.Stats().Partitions)
		if n == 0 {
			return false
		}
		total += n
	}
	return total == rollPartitions
}

func waitBalanced(ins []*rollInstance) error {
	deadline := time.Now().Add(rollStable)
	for !rollBalanced(ins) {
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: rolling restart: the group did not settle in %s", rollStable)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// rollRun runs one rolling restart on a new consumer group of topic and
// returns the steady rate (median of the 1-s rates before the first
// restart) and the lowest 1-s rate from the first restart until the group
// settled after the last one.
func (r *parRig) rollRun(ctx context.Context, topic string, coop bool) (steady, lowest float64, err error) {
	group := fmt.Sprintf("bench-roll-%d", r.seq.Add(1))
	var applied atomic.Int64
	ins := make([]*rollInstance, 0, rollInstances)
	defer func() {
		for _, in := range ins {
			in.stop()
		}
	}()
	for range rollInstances {
		in, err := r.rollStart(ctx, topic, group, coop, &applied)
		if err != nil {
			return 0, 0, err
		}
		ins = append(ins, in)
	}
	if err := waitBalanced(ins); err != nil {
		return 0, 0, err
	}
	time.Sleep(time.Second) // past the first fetches
	rates := sampleRates(&applied)
	time.Sleep(rollSteady)
	steadyRates := rates.take()
	for i := range ins {
		ins[i].stop()
		in, err := r.rollStart(ctx, topic, group, coop, &applied)
		if err != nil {
			ins = slices.Delete(ins, i, i+1)
			return 0, 0, err
		}
		ins[i] = in
		if err := waitBalanced(ins); err != nil {
			return 0, 0, err
		}
		time.Sleep(rollSettle)
	}
	during := rates.take()
	rates.stop()
	if len(steadyRates) == 0 || len(during) == 0 {
		return 0, 0, fmt.Errorf("bench: rolling restart: no samples")
	}
	r.o.Logf("    %s, 1-s rates: steady %v, during the restarts %v", map[bool]string{false: "eager", true: "cooperative"}[coop], steadyRates, during)
	return Summarise(steadyRates).Median, slices.Min(during), nil
}

// rateSampler records, every second, how many events were applied in it.
type rateSampler struct {
	tick  *time.Ticker
	done  chan struct{}
	rates chan []float64
	reset chan struct{}
}

func sampleRates(applied *atomic.Int64) *rateSampler {
	s := &rateSampler{tick: time.NewTicker(time.Second), done: make(chan struct{}), rates: make(chan []float64), reset: make(chan struct{})}
	go func() {
		var got []float64
		last := applied.Load()
		for {
			select {
			case <-s.tick.C:
				n := applied.Load()
				got = append(got, float64(n-last))
				last = n
			case s.rates <- got:
				got = nil
			case <-s.done:
				return
			}
		}
	}()
	return s
}

// take returns the rates recorded since the last take.
func (s *rateSampler) take() []float64 { return <-s.rates }

func (s *rateSampler) stop() {
	s.tick.Stop()
	close(s.done)
}

func rollingRestart(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	rounds := max(o.Rounds/2, 1)
	if o.Short {
		rounds = 1
	}
	topic := fmt.Sprintf("bench-roll-%d", r.seq.Add(1))
	if err := kafkatest.CreateTopic(r.brokers, topic, rollPartitions); err != nil {
		return Section{}, err
	}
	// Enough for every run to read from a backlog throughout.
	capacity := float64(rollInstances*rollInFlight) / rollCall.Seconds()
	backlog := int(capacity * 60)
	if err := r.produce(topic, backlog, 0); err != nil {
		return Section{}, err
	}
	type result struct{ steady, lowest, ratio []float64 }
	res := map[bool]*result{false: {}, true: {}}
	run := func(coop bool) func() (float64, error) {
		return func() (float64, error) {
			steady, lowest, err := r.rollRun(ctx, topic, coop)
			if err != nil {
				return 0, err
			}
			x := res[coop]
			x.steady, x.lowest, x.ratio = append(x.steady, steady), append(x.lowest, lowest), append(x.ratio, lowest/steady)
			return lowest / steady, nil
		}
	}
	if _, err := Rotate(rounds, run(false), run(true)); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for _, coop := range []bool{true, false} {
		x, name, target := res[coop], "eager (range)", "–"
		if coop {
			name = "cooperative-sticky"
			target = fmt.Sprintf("≥ 0.5×: %s", pass(Summarise(x.ratio).Median >= 0.5))
		}
		st := Summarise(x.ratio)
		o.Logf("  rolling restart, %s: steady %s msg/s, lowest 1-s %s msg/s, ratio %s", name, fmtRate(x.steady), fmtRate(x.lowest), st)
		rows = append(rows, []string{name, fmtRate(x.steady), fmtRate(x.lowest), st.String(), target})
	}
	var b strings.Builder
	b.WriteString(Table([]string{"rebalance strategy", "steady msg/s (median)", "lowest 1-s msg/s (median)", "lowest / steady", "target"}, rows))
	fmt.Fprintf(&b, "\nKafka (%s, %d partitions) → watermill Router → dedup middleware (one transaction per message) → handler "+
		"(one business row, then a %s wait in the transaction); %d instances of the parallel subscriber in one consumer group, "+
		"MaxInFlight %d each (the group's ceiling %.0f msg/s), Sarama's defaults otherwise (heartbeat 3 s), pool of %d connections, "+
		"a backlog of %d events. Steady state is the median 1-s rate over %s once every instance holds partitions; then each instance "+
		"in turn is closed and a new one started (a leave and a join), the next once the group is balanced again plus %s. Lowest is "+
		"the lowest 1-s rate from the first close to the end. %d round(s), the two strategies alternated, each run a new consumer group.\n",
		kafkaDesc(o.Brokers), rollPartitions, rollCall, rollInstances, rollInFlight, capacity, parPoolConns, backlog, rollSteady, rollSettle, rounds)
	return Section{Title: "Rolling restart (idemkafka/parallel): the lowest 1-s rate, cooperative-sticky and eager", Markdown: b.String()}, nil
}
