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

// franzRollStart starts instance idx of the rolling-restart workload on
// the franz-go subscriber with protocol ("classic": cooperative-sticky;
// "consumer": KIP-848), a static member named after idx when static; each
// event it applies adds to applied and to its own count; stop closes it.
func (r *parRig) franzRollStart(ctx context.Context, topic, group, protocol string, static bool, idx int, applied, own *atomic.Int64) (stop func(), err error) {
	cfg := franz.SubscriberConfig{Brokers: r.brokers, ConsumerGroup: group, GroupProtocol: protocol,
		MaxInFlight: rollInFlight, ClientOpts: []kgo.Opt{kgo.FetchMaxWait(500 * time.Millisecond)}}
	if static {
		cfg.InstanceID = fmt.Sprintf("bench-instance-%d", idx)
	}
	sub, err := franz.NewSubscriber(cfg, nil)
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
		own.Add(1)
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
// (median 1-s rate, from when every instance applies events) and the
// lowest 1-s rate from the first restart to franzRollSettle after the last.
func (r *parRig) franzRollRun(ctx context.Context, topic, protocol string, static bool) (steady, lowest float64, err error) {
	group := fmt.Sprintf("bench-froll-%d", r.seq.Add(1))
	var applied atomic.Int64
	owns := make([]*atomic.Int64, rollInstances)
	stops := make([]func(), 0, rollInstances)
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	for i := range rollInstances {
		owns[i] = new(atomic.Int64)
		stop, err := r.franzRollStart(ctx, topic, group, protocol, static, i, &applied, owns[i])
		if err != nil {
			return 0, 0, err
		}
		stops = append(stops, stop)
	}
	// The steady window starts when every instance has partitions: a
	// KIP-848 member that joins after the first waits for the first's
	// next heartbeat (5 s by default) to release some.
	if err := waitAllApply(owns, 30*time.Second); err != nil {
		return 0, 0, fmt.Errorf("bench: rolling restart (franz-go, %s): %w", protocol, err)
	}
	time.Sleep(time.Second)
	rates := sampleRates(&applied)
	time.Sleep(rollSteady)
	steadyRates := rates.take()
	for i := range stops {
		stops[i]()
		stop, err := r.franzRollStart(ctx, topic, group, protocol, static, i, &applied, owns[i])
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
	r.o.Logf("    franz-go %s (static %v), 1-s rates: steady %v, during the restarts %v", protocol, static, steadyRates, during)
	return Summarise(steadyRates).Median, slices.Min(during), nil
}

// waitAllApply waits until each of owns has grown within 500 ms, at most
// limit.
func waitAllApply(owns []*atomic.Int64, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		before := make([]int64, len(owns))
		for i, o := range owns {
			before[i] = o.Load()
		}
		time.Sleep(500 * time.Millisecond)
		all := true
		for i, o := range owns {
			all = all && o.Load() > before[i]
		}
		if all {
			return nil
		}
	}
	return fmt.Errorf("not every instance applied events within %s", limit)
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
	// Dynamic members, then static ones (InstanceID): a restarted static
	// member gets its own partitions back, so none moves.
	type variant struct {
		protocol string
		static   bool
		name     string
		steady   []float64
		lowest   []float64
		ratio    []float64
	}
	vs := []*variant{
		{protocol: "consumer", name: "KIP-848 (GroupProtocol \"consumer\")"},
		{protocol: "classic", name: "classic, cooperative-sticky"},
		{protocol: "consumer", static: true, name: "KIP-848, static members (InstanceID)"},
		{protocol: "classic", static: true, name: "classic, cooperative-sticky, static members (InstanceID)"},
	}
	fns := make([]func() (float64, error), len(vs))
	for i, v := range vs {
		fns[i] = func() (float64, error) {
			steady, lowest, err := r.franzRollRun(ctx, topic, v.protocol, v.static)
			if err != nil {
				return 0, err
			}
			v.steady, v.lowest, v.ratio = append(v.steady, steady), append(v.lowest, lowest), append(v.ratio, lowest/steady)
			return lowest / steady, nil
		}
	}
	if _, err := Rotate(rounds, fns...); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for i, v := range vs {
		target := "–"
		if v.protocol == "consumer" {
			ratio := Summarise(pairRatios(vs[i+1].lowest, v.lowest))
			target = fmt.Sprintf("lowest ≥ 1× cooperative-sticky's: %s (%s)", pass(ratio.Median >= 1), ratio)
			o.Logf("  rolling restart (franz-go, static %v): lowest 1-s KIP-848 %.0f, cooperative-sticky %.0f msg/s, ratio %s",
				v.static, Summarise(v.lowest).Median, Summarise(vs[i+1].lowest).Median, ratio)
		}
		rows = append(rows, []string{v.name, fmtRate(v.steady), fmtRate(v.lowest), Summarise(v.ratio).String(), target})
	}
	var b strings.Builder
	b.WriteString(Table([]string{"group protocol", "steady msg/s (median)", "lowest 1-s msg/s (median)", "lowest / steady", "target"}, rows))
	fmt.Fprintf(&b, "\nThe rolling-restart section's workload (%d instances, MaxInFlight %d, %d partitions, a %s wait in the transaction) on "+
		"the franz-go subscriber; each instance in turn is closed and a new one started, the next %s later (no balance to wait on). "+
		"The steady rate is measured once every instance applies events. "+
		"Dynamic members (the first two rows): a closed member's partitions move to the others, and the new member's are taken from them; "+
		"with KIP-848 each move waits for the owner's next heartbeat (group.consumer.heartbeat.interval.ms, 5 s by default), "+
		"so the restarted member can wait up to that long. Static members (franz.SubscriberConfig.InstanceID, the last two rows): "+
		"the restarted member gets its own partitions back and none moves. "+
		"%d round(s), the four variants rotated, each run a new consumer group; the ratio is KIP-848's lowest 1-s rate over cooperative-sticky's of the same round and membership.\n",
		rollInstances, rollInFlight, rollPartitions, rollCall, franzRollSettle, rounds)
	return Section{Title: "Rolling restart (idemkafka/franz): KIP-848 against cooperative-sticky", Markdown: b.String()}, nil
}
