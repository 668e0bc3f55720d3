package bench

import (
	"context"
	"fmt"
	"strings"
	"time"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("end-to-end", endToEnd) }

const (
	e2ePartitions = 8
	// sentAtKey carries the publish time (Unix nanoseconds) from the input
	// record, through the handler and the outbox, to the forwarded record.
	sentAtKey = "bench_sent_at"
	// warmupKey marks the events published before a paced round's measured
	// ones (see pipelineWith): they are handled and forwarded, not counted.
	warmupKey = "bench_warmup"
	// publishedAtKey carries the time the handler published the event to
	// the outbox (inside the dedup transaction, before its COMMIT).
	publishedAtKey = "bench_published_at"
	// e2eDefaultPollInterval is outbox.ForwarderConfig.PollInterval's
	// default.
	e2eDefaultPollInterval = 100 * time.Millisecond
)

func endToEnd(ctx context.Context, o Options) (Section, error) {
	e := e2eRun{o: o, n: 6000, rounds: 3, liveN: 4000, slowN: 200, fwdWait: 10 * time.Second}
	if o.Short {
		e.n, e.rounds, e.liveN, e.slowN, e.fwdWait = 1500, 2, 500, 60, 5*time.Second
	}
	r, err := newE2ERig(ctx, o, e.n)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	e.r = r
	e.holders = []string{r.xminHolder(ctx)}
	if err := e.throughput(ctx); err != nil {
		return Section{}, err
	}
	e.holders = append(e.holders, r.xminHolder(ctx))
	if err := e.latency(ctx); err != nil {
		return Section{}, err
	}
	e.holders = append(e.holders, r.xminHolder(ctx))
	return Section{Title: "End to end: Kafka → dedup → Postgres → outbox → forwarder → Kafka", Markdown: e.markdown()}, nil
}

// e2eSlowRate is the rate (msg/s) of the end-to-end section's slow
// latency round, where the forwarder idles between events.
const e2eSlowRate = 20

// e2eRun is one run of the end-to-end section: its sizes, what it
// measured and the rows of its tables.
type e2eRun struct {
	o                       Options
	r                       *e2eRig
	n, rounds, liveN, slowN int
	fwdWait                 time.Duration
	// The rates of the rounds: the pipeline (consumed, forwarded when
	// complete), with NOTIFY, and the parallel subscriber's (parForwarded,
	// against watermill-kafka's wkForwarded, 0 when incomplete).
	forwarded, consumed, consumedNotify, parForwarded, wkForwarded []float64
	// consumedNoProgress: the watermill-kafka round with
	// Config.SkipProgress (no position kept in PostgreSQL).
	consumedNoProgress []float64
	// consumedSubProgress: the watermill-kafka round whose subscriber
	// keeps the position (idemkafka.ClientConfig.Progress).
	consumedSubProgress []float64
	// parCPU and wkCPU are the same rounds' CPU time per event
	// (e2eResult.cpuPerEvent, 0 when incomplete).
	parCPU, wkCPU []time.Duration
	// parServerCPU and wkServerCPU are their PostgreSQL backends' CPU time
	// per event (e2eResult.serverCPUPerEvent).
	parServerCPU, wkServerCPU []time.Duration
	incomplete                int // rounds not forwarded within fwdWait
	notifyRatios              []float64
	liveRate                  float64
	holders                   []string // xminHolder before, between and after
	rows, parTable, latRows   [][]string
}

// round is one watermill-kafka round (notify: with the outbox's notify
// trigger and the forwarder's Listen).
func (e *e2eRun) round(ctx context.Context, notify bool) func() (float64, error) {
	return func() (float64, error) {
		res, err := e.r.pipelineWith(ctx, pipelineSpec{in: e.r.in, n: e.n, fwdWait: e.fwdWait, notify: notify})
		if err != nil {
			return 0, err
		}
		if notify {
			e.consumedNotify = append(e.consumedNotify, res.consumed)
			return res.consumed, nil
		}
		e.consumed = append(e.consumed, res.consumed)
		e.wkForwarded = append(e.wkForwarded, res.forwarded)
		e.wkCPU, e.wkServerCPU = append(e.wkCPU, res.cpuPerEvent), append(e.wkServerCPU, res.serverCPUPerEvent)
		if res.complete {
			e.forwarded = append(e.forwarded, res.forwarded)
		} else {
			e.incomplete++
			e.o.Logf("  end-to-end: only %d of %d records forwarded within %s after consumption ended", res.forwardedNum, e.n, e.fwdWait)
		}
		return res.consumed, nil
	}
}

// noProgressRound is the watermill-kafka round with Config.SkipProgress:
// the dedup transactions keep no position in PostgreSQL.
func (e *e2eRun) noProgressRound(ctx context.Context) func() (float64, error) {
	return func() (float64, error) {
		res, err := e.r.pipelineWith(ctx, pipelineSpec{in: e.r.in, n: e.n, fwdWait: e.fwdWait, skipProgress: true})
		if err != nil {
			return 0, err
		}
		e.consumedNoProgress = append(e.consumedNoProgress, res.consumed)
		return res.consumed, nil
	}
}

// subProgressRound is the watermill-kafka round whose subscriber keeps the
// position in PostgreSQL itself (idemkafka.ClientConfig.Progress): one
// write per flush instead of one per dedup transaction.
func (e *e2eRun) subProgressRound(ctx context.Context) func() (float64, error) {
	return func() (float64, error) {
		res, err := e.r.pipelineWith(ctx, pipelineSpec{in: e.r.in, n: e.n, fwdWait: e.fwdWait, subscriberProgress: true})
		if err != nil {
			return 0, err
		}
		e.consumedSubProgress = append(e.consumedSubProgress, res.consumed)
		return res.consumed, nil
	}
}

// parRound is a round of the parallel subscriber with group commit,
// forwarded and read back, against the watermill-kafka row's forwarded
// rate of the same round (0 for a round not forwarded within fwdWait).
func (e *e2eRun) parRound(ctx context.Context) (float64, error) {
	res, err := e.r.pipelineWith(ctx, pipelineSpec{in: e.r.in, n: e.n, fwdWait: e.fwdWait, groupCommit: &idem.GroupCommitConfig{}, parallel: parMaxInFlight})
	if err != nil {
		return 0, fmt.Errorf("parallel subscriber, group commit: %w", err)
	}
	e.parForwarded = append(e.parForwarded, res.forwarded)
	e.parCPU, e.parServerCPU = append(e.parCPU, res.cpuPerEvent), append(e.parServerCPU, res.serverCPUPerEvent)
	return res.consumed, nil
}

// throughput drains a backlog in each kind of round, rotated with the
// ceiling, and makes the throughput tables' rows.
func (e *e2eRun) throughput(ctx context.Context) error {
	rates, err := Rotate(e.rounds, func() (float64, error) { return e.r.ceiling(ctx) }, e.round(ctx, false), e.round(ctx, true),
		func() (float64, error) { return e.parRound(ctx) }, e.noProgressRound(ctx), e.subProgressRound(ctx))
	if err != nil {
		return err
	}
	base := rates[0]
	ratios, withNotifyRatios := Ratios(base, e.consumed), Ratios(base, e.consumedNotify)
	e.notifyRatios = Ratios(e.consumed, e.consumedNotify)
	cst := Summarise(ratios)
	e.o.Logf("  end-to-end: ceiling %s msg/s, consumed %s msg/s (ratio %s; with NOTIFY %s), forwarded %v msg/s", fmtRate(base), fmtRate(e.consumed), cst, Summarise(withNotifyRatios), e.forwarded)
	e.rows = [][]string{
		{"no-op handler, no database (ceiling)", fmtRate(base), "1"},
		{"dedup + business row + outbox row, committed", fmtRate(e.consumed), cst.String()},
		{"… the same with the outbox's notify trigger enabled (NOTIFY at commit, forwarder Listen)", fmtRate(e.consumedNotify), Summarise(withNotifyRatios).String()},
	}
	if e.incomplete == 0 {
		e.rows = append(e.rows, []string{"… and forwarded to Kafka by the forwarder, read back", fmtRate(e.forwarded), Summarise(Ratios(base, e.forwarded)).String()})
	} else {
		e.rows = append(e.rows, []string{"… and forwarded to Kafka by the forwarder, read back",
			fmt.Sprintf("not measured: %d of %d rounds not forwarded within %s", e.incomplete, e.rounds, e.fwdWait), "–"})
	}
	progress := Summarise(Ratios(e.consumedNoProgress, e.consumed))
	e.o.Logf("  end-to-end: with/without the progress record: %s", progress)
	e.rows = append(e.rows, []string{"… dedup + business row + outbox row without the progress record (`Config.SkipProgress`); ratio: with / without",
		fmtRate(e.consumedNoProgress), progress.String()})
	subProgress := Summarise(Ratios(e.consumedNoProgress, e.consumedSubProgress))
	e.o.Logf("  end-to-end: position kept by the subscriber / none: %s", subProgress)
	e.rows = append(e.rows, []string{"… with the position kept by the subscriber (`idemkafka.ClientConfig.Progress`: one write per flush, none per transaction); ratio: with / without",
		fmtRate(e.consumedSubProgress), subProgress.String()})
	e.parTable = parallelE2ETable(e2eRows{e.wkForwarded, e.parForwarded, e.wkCPU, e.parCPU, e.wkServerCPU, e.parServerCPU}, rates[3])
	e.o.Logf("  end-to-end, parallel subscriber with group commit: %s", e.parTable[0][3:])
	return nil
}

// e2eLatencyRound is one latency round of the end-to-end section.
type e2eLatencyRound struct {
	name   string
	notify bool // the notify trigger enabled, the forwarder's Listen
	hold   bool // a transaction holds an id open in another database all along
	slow   bool // at e2eSlowRate
}

// latency feeds a fresh input topic at half the consuming side's median
// rate while the pipeline runs, so records do not queue behind a backlog:
// the forwarder's defaults (wake-up on commit), the same with a
// transaction holding an id open in another database of the server for
// the whole measurement, and polling alone; and makes the latency table's
// rows.
func (e *e2eRun) latency(ctx context.Context) error {
	e.liveRate = Summarise(e.consumed).Median / 2
	foreign, err := e.r.foreignHolder(ctx)
	if err != nil {
		return err
	}
	defer foreign.close()
	var quietP99 time.Duration
	for _, v := range []e2eLatencyRound{
		{"defaults", false, false, false},
		{"defaults, a transaction holding an id open in another database all along", false, true, false},
		{"notify trigger enabled, Listen", true, false, false},
		{fmt.Sprintf("defaults, at %d msg/s (the forwarder idles between events)", e2eSlowRate), false, false, true},
	} {
		if err := e.latencyRound(ctx, v, foreign, &quietP99); err != nil {
			return err
		}
	}
	return nil
}

// latencyRound runs v and adds its row; quietP99 is the first row's
// publish→Kafka p99, set by the first row.
func (e *e2eRun) latencyRound(ctx context.Context, v e2eLatencyRound, foreign *foreignTx, quietP99 *time.Duration) error {
	live, err := e.r.topic("bench-live")
	if err != nil {
		return err
	}
	if v.hold {
		if err := foreign.hold(ctx); err != nil {
			return err
		}
	}
	n, rate := e.liveN, e.liveRate
	if v.slow {
		n, rate = e.slowN, e2eSlowRate
	}
	res, err := e.r.pipelineWith(ctx, pipelineSpec{in: live, n: n, produceRate: rate, fwdWait: e.fwdWait, notify: v.notify})
	held := ""
	if v.hold {
		held, err = foreign.release(ctx, err)
	}
	if err != nil {
		return err
	}
	if !res.complete {
		e.o.Logf("  end-to-end latency, %s: only %d of %d forwarded within %s", v.name, res.forwardedNum, n, e.fwdWait)
		e.latRows = append(e.latRows, []string{v.name, "not measured", "", "", "", fmt.Sprintf("%d of %d forwarded within %s", res.forwardedNum, n, e.fwdWait)})
		return nil
	}
	p50, p99 := percentile(res.latencies, 0.50), percentile(res.latencies, 0.99)
	k50, k99 := percentile(res.toKafka, 0.50), percentile(res.toKafka, 0.99)
	rel := ""
	switch {
	case v.slow:
		rel = fmt.Sprintf("%d events", n)
	case *quietP99 == 0:
		*quietP99 = k99
		rel = "target p99 ≤ 20ms: met"
		if k99 > relayTarget {
			rel = fmt.Sprintf("target p99 ≤ 20ms: not met (+%s; load average %s; see the relay-steps section)", fmtDur(k99-relayTarget), loadAverage())
		}
	default:
		rel = fmt.Sprintf("%.2f× the first row's publish→Kafka p99", float64(k99)/float64(*quietP99))
		if held != "" {
			rel += "; " + held
		}
	}
	e.o.Logf("  end-to-end latency at %.0f msg/s, %s: p50 %s, p99 %s (outbox publish→Kafka p50 %s p99 %s, of which publish→COMMIT returned p50 %s p99 %s)", rate, v.name, p50, p99,
		percentile(res.toKafka, 0.5), percentile(res.toKafka, 0.99), percentile(res.toCommit, 0.5), percentile(res.toCommit, 0.99))
	r := func(d time.Duration) string { return d.Round(100 * time.Microsecond).String() }
	e.latRows = append(e.latRows, []string{v.name, r(k50), r(k99), r(p50), r(p99), rel})
	return nil
}

// markdown is the section's text: its tables and what they measure.
func (e *e2eRun) markdown() string {
	o, n, rounds, liveN, liveRate := e.o, e.n, e.rounds, e.liveN, e.liveRate
	rows, parTable, latRows, notifyRatios, holders := e.rows, e.parTable, e.latRows, e.notifyRatios, e.holders
	var b strings.Builder
	b.WriteString(Table([]string{"consumer", "msg/s (median)", "ratio to ceiling"}, rows))
	fmt.Fprintf(&b, "\nKafka (%s) → watermill Router (watermill-kafka subscriber, %d partitions, one handler per partition) → "+
		"dedup middleware → handler writing one business row and returning one event → outbox row in the same transaction → "+
		"forwarder (Sarama idempotent producer, default settings) → Kafka → a consumer of the forwarded topic. "+
		"Each round drains a backlog of %d events with a new consumer group; rates run from the first handled event to the last committed one "+
		"(second row) or to the last forwarded record read back (third row); the ceiling is the same router with a no-op handler. %d rounds, alternated.\n\n",
		kafkaDesc(o.Brokers), e2ePartitions, n, rounds)
	b.WriteString("The ceiling is Kafka consumption alone (no database, no per-message transaction); the library's own cost against " +
		"a plain transaction is the dedup-overhead section above.\n\n")
	b.WriteString(Table([]string{"workload", "subject", "baseline", "msg/s (median)", "ratio to baseline", "target",
		"CPU per event (subject)", "CPU per event (baseline)", "CPU per event, baseline / subject",
		"PostgreSQL CPU per event (subject)", "PostgreSQL CPU per event (baseline)"}, parTable))
	fmt.Fprintf(&b, "\nThe same pipeline on the parallel subscriber (MaxInFlight %d, `idem.Config.Concurrency: sub.MaxInFlight()`) with "+
		"`Config.Mode = &GroupCommitConfig{}` at its defaults, in the same rotation as the rows above (same backlog, pool and forwarder); "+
		"rate from the first handled event to the last forwarded record read back; ratio = its rate / the watermill-kafka "+
		"row's forwarded rate of the same round (the fourth row above). CPU per event is this process's user + system CPU time "+
		"(getrusage) over the same span, divided by the events: the subscriber, the middleware, the forwarder, the reader of the "+
		"forwarded topic and %s; PostgreSQL's backends are other processes and not in it: "+
		"PostgreSQL CPU per event is the CPU time of the pool's backends (read from /proc, n/a elsewhere) over the whole round, per event.\n\n", parMaxInFlight, brokerCPUDesc(o.Brokers))
	fmt.Fprintf(&b, "\nThe second and third rows alternate round by round (with the ceiling): the third enables the outbox table's notify trigger, "+
		"so every writer sends a NOTIFY, whose commit-time lock is the wake-up's cost; their ratio (with NOTIFY / without) is %s.\n\n",
		Summarise(notifyRatios))
	fmt.Fprintf(&b, "Latency of %d events published to the input topic at %.0f msg/s (half the median consuming rate), after %d warm-up events "+
		"(the consumer group joined, connections open): **publish→Kafka** runs from the handler's publish to the outbox (inside the dedup "+
		"transaction, before its COMMIT) to the broker's acknowledgement of the forwarded record (the forwarder's SendMessages call for "+
		"its batch returned, acks=all): the outbox's own latency; **end to end** from the publish to the input topic to the forwarded "+
		"record's arrival at a consumer of the output topic (so it also holds that consumer's fetch). With the forwarder's defaults (it polls: 1 ms after a read that found rows, doubling "+
		"after each empty one up to PollInterval %s, and writes in the same process wake it), the same while a transaction holds an id open in "+
		"another database of the server for the whole measurement, with the NOTIFY wake-up on commit, and with the defaults at a low rate, "+
		"where the forwarder idles between two events (its waits have grown toward PollInterval, and the write's wake-up ends them):\n\n",
		liveN, liveRate, warmupEvents, e2eDefaultPollInterval)
	b.WriteString(Table([]string{"forwarder", "publish→Kafka p50", "publish→Kafka p99", "end to end p50", "end to end p99", ""}, latRows))
	var seen []string
	for _, h := range holders {
		if h != "" {
			seen = append(seen, h)
		}
	}
	if len(seen) > 0 {
		fmt.Fprintf(&b, "\nWhile this ran, the server had %s (the forwarder does not wait for such transactions).\n", strings.Join(seen, "; then "))
	}
	return b.String()
}

func kafkaDesc(brokers []string) string {
	if len(brokers) == 0 {
		return "in-process kfake broker over TCP"
	}
	return strings.Join(brokers, ",")
}

// brokerCPUDesc says whether the broker's CPU time is in the process's.
func brokerCPUDesc(brokers []string) string {
	if len(brokers) == 0 {
		return "the in-process kfake broker (which serves every round's reads and writes)"
	}
	return "not the broker (an external one)"
}

// e2eRows are the end-to-end rounds of both subscribers, round by round:
// forwarded rates (0: not forwarded in full) and CPU time per event.
type e2eRows struct {
	wkForwarded, parForwarded []float64
	wkCPU, parCPU             []time.Duration
	wkServerCPU, parServerCPU []time.Duration
}

// parallelE2ETable is the end-to-end section's row for the parallel
// subscriber with group commit: its forwarded rate and CPU time per event
// (parConsumedRates only for the log) against the watermill-kafka row's,
// round by round; a round either side did not forward in full is left out.
func parallelE2ETable(r e2eRows, parConsumedRates []float64) [][]string {
	var wk, par, ratios, wkCPU, parCPU, cpuRatios, wkServer, parServer []float64
	for i := range min(len(r.wkForwarded), len(r.parForwarded)) {
		if r.wkForwarded[i] > 0 && r.parForwarded[i] > 0 {
			wk, par = append(wk, r.wkForwarded[i]), append(par, r.parForwarded[i])
			ratios = append(ratios, r.parForwarded[i]/r.wkForwarded[i])
			w, p := micros(r.wkCPU, i), micros(r.parCPU, i)
			wkCPU, parCPU = append(wkCPU, w), append(parCPU, p)
			if ws, ps := micros(r.wkServerCPU, i), micros(r.parServerCPU, i); ws > 0 && ps > 0 {
				wkServer, parServer = append(wkServer, ws), append(parServer, ps)
			}
			if p > 0 {
				cpuRatios = append(cpuRatios, w/p)
			}
		}
	}
	row := []string{"Kafka → dedup → outbox → forwarder → Kafka, forwarded and read back",
		fmt.Sprintf("parallel subscriber (MaxInFlight %d), group commit (defaults)", parMaxInFlight),
		"watermill-kafka subscriber, one transaction per message (forwarded, read back)"}
	if len(ratios) == 0 {
		return [][]string{append(row, fmt.Sprintf("not measured: no round forwarded in full (committed %s msg/s)", fmtRate(parConsumedRates)), "–", "≥ 4×: not measured", "–", "–", "–", "–", "–")}
	}
	st := Summarise(ratios)
	return [][]string{append(row, fmtRate(par), st.String(), fmt.Sprintf("≥ 4× (baseline %s msg/s): %s", fmtRate(wk), pass(st.Median >= 4)),
		fmtMicros(parCPU), fmtMicros(wkCPU), Summarise(cpuRatios).String(), fmtMicros(parServer), fmtMicros(wkServer))}
}

// micros is xs[i] in microseconds, 0 past its end.
func micros(xs []time.Duration, i int) float64 {
	if i >= len(xs) {
		return 0
	}
	return float64(xs[i]) / float64(time.Microsecond)
}

// fmtMicros formats microseconds as "median µs (min–max)", "n/a" when xs
// is empty.
func fmtMicros(xs []float64) string {
	if len(xs) == 0 {
		return "n/a"
	}
	s := Summarise(xs)
	return fmt.Sprintf("%.0fµs (%.0f–%.0f)", s.Median, s.Min, s.Max)
}
