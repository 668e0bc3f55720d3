package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// latRounds is how many latency runs each consumer of a workload gets.
func latRounds(o Options) int {
	if o.Short {
		return 1
	}
	return min(max(o.Rounds, 1), 3)
}

func latRoundsDesc(o Options) string {
	if o.Short {
		return "One run (the candidate alone)"
	}
	return fmt.Sprintf("%d runs of each row, rotated (the order shifted each round); cells are the median over runs. The last row is the "+
		"candidate at watermill-kafka's rate: its latency without ten times the events through the same process, broker and database", latRounds(o))
}

// latencyRows measures the latency of w's baseline and candidate: a fresh
// topic fed at half the consumer's median rate (from rates) for latFor
// while it consumes, latRounds times each, alternated; and the candidate
// again at the baseline's rate, which tells the subscriber's latency from
// that of the load (ten times the events through the same process, broker
// and database). In a -short run only the candidate at its rate runs.
func (r *parRig) latencyRows(ctx context.Context, o Options, w parWorkload, rates [][]float64, latFor time.Duration) ([][]string, error) {
	const runs = 3 // baseline, candidate, candidate at the baseline's rate
	var p50s, p99s, h50s, h99s [runs][]float64
	var ratios [runs][]float64
	rateOf := func(i int) float64 { return Summarise(rates[[runs]int{0, 1, 0}[i]]).Median / 2 }
	for round := range latRounds(o) {
		var p99 [runs]time.Duration
		for k := range runs {
			i := (k + round) % runs
			if o.Short && i != 1 {
				continue
			}
			c := w.consumers[[runs]int{0, 1, 1}[i]]
			lat, toHandler, err := r.latencyRun(ctx, c, w.handler, rateOf(i), max(50, int(rateOf(i)*latFor.Seconds())))
			if err != nil {
				return nil, fmt.Errorf("latency, %s, %s: %w", w.name, c.name, err)
			}
			p99[i] = percentile(lat, 0.99)
			p50s[i], p99s[i] = append(p50s[i], float64(percentile(lat, 0.50))), append(p99s[i], float64(p99[i]))
			h50s[i], h99s[i] = append(h50s[i], float64(percentile(toHandler, 0.50))), append(h99s[i], float64(percentile(toHandler, 0.99)))
			o.Logf("  parallel latency, %s, %s at %.0f msg/s: p50 %s, p99 %s (to the handler p50 %s, p99 %s)", w.name, c.name, rateOf(i),
				percentile(lat, 0.50), p99[i], percentile(toHandler, 0.50), percentile(toHandler, 0.99))
		}
		for i := 1; i < runs; i++ {
			if p99[0] > 0 && p99[i] > 0 {
				ratios[i] = append(ratios[i], float64(p99[i])/float64(p99[0]))
			}
		}
	}
	med := func(xs []float64) string { return fmtDur(time.Duration(Summarise(xs).Median)) }
	var rows [][]string
	for i := range runs {
		if len(p99s[i]) == 0 {
			continue
		}
		name := w.consumers[[runs]int{0, 1, 1}[i]].name
		rel := "–"
		if len(ratios[i]) > 0 {
			st := Summarise(ratios[i])
			rel = st.String()
			if i == 1 && w.latencyTarget > 0 {
				rel += fmt.Sprintf(" (≤ %g×: %s)", w.latencyTarget, pass(st.Median <= w.latencyTarget))
			}
		}
		if i == 2 {
			name += ", at watermill-kafka's rate"
		}
		rows = append(rows, []string{w.name, name, fmt.Sprintf("%.0f", rateOf(i)), fmt.Sprint(max(50, int(rateOf(i)*latFor.Seconds()))),
			med(h50s[i]), med(h99s[i]), med(p50s[i]), med(p99s[i]), rel})
	}
	return rows, nil
}

// latencyRun is one latency run: c consumes a fresh topic fed with n
// events at rate after warmupEvents warm-up events (the consumer group
// joined, the partitions fetched, connections open: an event published
// during the join waits for it, and at a higher rate more of them would
// fill the top percentile). It returns each event's time from publish to
// commit and from publish to the router's call of the handler.
func (r *parRig) latencyRun(ctx context.Context, c parConsumer, handler func(*message.Message) error, rate float64, n int) (lat, toHandler []time.Duration, err error) {
	live, err := r.topic("bench-par-live")
	if err != nil {
		return nil, nil, err
	}
	if err := r.produceMarked(live, warmupEvents, 0, true); err != nil {
		return nil, nil, err
	}
	var l, h durations
	warmed := make(chan struct{})
	prodErr := make(chan error, 1)
	pctx, cancel := context.WithCancel(ctx)
	defer cancel() // a run that fails before the warm-up ends stops the producer's wait
	go func() {
		select {
		case <-warmed:
			prodErr <- r.produce(live, n, rate)
		case <-pctx.Done():
			prodErr <- pctx.Err()
		}
	}()
	_, runErr := r.run(ctx, c, parRun{topic: live, count: warmupEvents + n, handler: handler, lat: &l, toHandler: &h, warmup: warmupEvents, warmed: warmed})
	if runErr != nil {
		return nil, nil, runErr
	}
	if err := <-prodErr; err != nil {
		return nil, nil, err
	}
	return l.xs, h.xs, nil
}
