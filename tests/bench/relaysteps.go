package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/relaystep"
)

func init() { Register("relay-steps", relaySteps) }

// relayTarget is the publish→Kafka p99 the relay aims at, at half the
// consuming rate on a loaded 2-core machine.
const relayTarget = 20 * time.Millisecond

// stepLog records a forwarder's steps (one topic) and the measured rows'
// times, for one paced round.
type stepLog struct {
	mu    sync.Mutex
	steps []stepAt
	// rows by publish time (publishedAtKey): COMMIT returned, broker ack.
	committed, acked map[int64]time.Time
}

type stepAt struct {
	step relaystep.Step
	at   time.Time
}

func newStepLog() *stepLog {
	return &stepLog{committed: map[int64]time.Time{}, acked: map[int64]time.Time{}}
}

func (l *stepLog) observe(_ string, s relaystep.Step, at time.Time) {
	l.mu.Lock()
	l.steps = append(l.steps, stepAt{s, at})
	l.mu.Unlock()
}

func (l *stepLog) commit(p int64, at time.Time) { l.mu.Lock(); l.committed[p] = at; l.mu.Unlock() }
func (l *stepLog) ack(p int64, at time.Time)    { l.mu.Lock(); l.acked[p] = at; l.mu.Unlock() }

// pageTimes is one page sent, as the steps show it: the read that took its
// rows (from its start to its records made), and its send.
type pageTimes struct {
	readFrom, readEnd, sendStart, sendEnd time.Time
}

// stepNames are the intervals of the step table, in order.
var stepNames = []string{
	"take a connection, BEGIN + lock the position",
	"read a new cut and its first page (one round trip)",
	"make the first page's records (or read the page apart)",
	"send a page to the broker",
	"position update + the next read (page, or new cut and its first page), records made",
	"wait for the send after that",
	"COMMIT",
	"pause after a transaction (timer, or a wake-up)",
	"look for a new cut (no lock; after an empty transaction)",
	"from COMMIT returned to the next BEGIN, pauses and looks excluded",
	"whole transaction, BEGIN to COMMIT returned",
}

// replay walks the steps: it returns the durations seen per name of
// stepNames, the pages sent, the pauses and the transactions committed.
func (l *stepLog) replay() (durs map[string][]time.Duration, pages []pageTimes, pauses [][2]time.Time, txs int) {
	durs = map[string][]time.Duration{}
	add := func(k int, from, to time.Time) {
		if !from.IsZero() && !to.IsZero() && !to.Before(from) {
			durs[stepNames[k]] = append(durs[stepNames[k]], to.Sub(from))
		}
	}
	var (
		begin, locked, cut, commit, lastCommitted, pauseStart, pollStart time.Time
		readFrom, readEnd, acked                                         time.Time
		gap                                                              time.Duration
		cur                                                              = -1 // the page in flight
	)
	waited := func() { // the loop waited for page cur's send after its update
		if cur >= 0 && !acked.IsZero() && !pages[cur].sendEnd.IsZero() {
			add(5, acked, later(acked, pages[cur].sendEnd))
		}
		acked = time.Time{}
	}
	for _, s := range l.steps {
		switch s.step {
		case relaystep.Begin:
			if !lastCommitted.IsZero() {
				add(9, lastCommitted, s.at.Add(-gap))
			}
			begin, gap = s.at, 0
		case relaystep.Locked:
			locked = s.at
			add(0, begin, s.at)
		case relaystep.Cut:
			cut = s.at
			add(1, locked, s.at)
		case relaystep.Read:
			add(2, cut, s.at)
			readFrom, readEnd = locked, s.at
		case relaystep.SendStart:
			waited()
			pages = append(pages, pageTimes{readFrom: readFrom, readEnd: readEnd, sendStart: s.at})
			cur = len(pages) - 1
		case relaystep.SendEnd:
			if cur >= 0 {
				pages[cur].sendEnd = s.at
				add(3, pages[cur].sendStart, s.at)
			}
		case relaystep.Update:
			readFrom = s.at
		case relaystep.Acked:
			readEnd, acked = s.at, s.at
			add(4, readFrom, s.at)
		case relaystep.Commit:
			waited()
			commit = s.at
		case relaystep.Committed:
			add(6, commit, s.at)
			add(10, begin, s.at)
			lastCommitted = s.at
			txs++
		case relaystep.PauseStart:
			pauseStart = s.at
		case relaystep.PauseEnd, relaystep.Woken:
			if !pauseStart.IsZero() {
				gap += s.at.Sub(pauseStart)
				pauses = append(pauses, [2]time.Time{pauseStart, s.at})
			}
			add(7, pauseStart, s.at)
			pauseStart = time.Time{}
		case relaystep.Poll:
			pollStart = s.at
		case relaystep.Polled:
			if !pollStart.IsZero() {
				gap += s.at.Sub(pollStart)
			}
			add(8, pollStart, s.at)
		}
	}
	return durs, pages, pauses, txs
}

// rowParts are the parts of one row's publish→Kafka latency.
var rowParts = []string{
	"publish → the writer's COMMIT returned",
	"→ the read that takes its row starts (the read in flight ends, sends, COMMIT, pause, BEGIN + lock)",
	"… of which pauses",
	"→ that read returned, records made",
	"→ its send starts (the page before it acknowledged)",
	"→ broker acknowledgement (send)",
}

// rowBreakdown returns, per measured row, its total publish→Kafka latency
// and its parts (rowParts), placing each row in the page whose send
// returned at its acknowledgement.
func (l *stepLog) rowBreakdown() (totals []time.Duration, parts [][]time.Duration) {
	_, pages, pauses, _ := l.replay()
	for p, acked := range l.acked {
		committed, ok := l.committed[p]
		// The send that acknowledged the row returned at or just after
		// acked (the producer's wrapper takes its time first).
		i, _ := slices.BinarySearchFunc(pages, acked, func(pg pageTimes, t time.Time) int { return pg.sendEnd.Compare(t) })
		if !ok || i == len(pages) || pages[i].readFrom.IsZero() {
			continue
		}
		pg := pages[i]
		published := time.Unix(0, p)
		b1 := committed
		b2 := later(b1, pg.readFrom)
		b3 := later(b2, pg.readEnd)
		b4 := later(b3, pg.sendStart)
		b5 := later(b4, acked)
		var paused time.Duration
		for _, pz := range pauses {
			from, to := later(pz[0], b1), pz[1]
			if to.After(b2) {
				to = b2
			}
			if to.After(from) {
				paused += to.Sub(from)
			}
		}
		totals = append(totals, acked.Sub(published))
		parts = append(parts, []time.Duration{b1.Sub(published), b2.Sub(b1), paused, b3.Sub(b2), b4.Sub(b3), b5.Sub(b4)})
	}
	return totals, parts
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func meanDur(xs []time.Duration) time.Duration {
	if len(xs) == 0 {
		return 0
	}
	var s time.Duration
	for _, x := range xs {
		s += x
	}
	return s / time.Duration(len(xs))
}

// relayVariant is one forwarder mode of the relay-steps section.
type relayVariant struct {
	name   string
	serial bool
	logs   []*stepLog
	p50    []time.Duration
	p99    []time.Duration
}

// relaySteps profiles the forwarder at half the consuming rate: the rate
// of the consuming side measured first (a backlog drained), then paced
// rounds whose forwarder reports its steps (relaystep), and each measured
// row's publish→Kafka latency in parts. Each round runs the forwarder as
// it is and as it was before its reads were pipelined (relaystep.WithSerial),
// order alternated.
func relaySteps(ctx context.Context, o Options) (Section, error) {
	n, liveN, rounds, fwdWait := 3000, 4000, min(max(o.Rounds, 1), 5), 10*time.Second
	if o.Short {
		n, liveN, rounds, fwdWait = 1000, 1000, 1, 5*time.Second
	}
	r, err := newE2ERig(ctx, o, n)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	res, err := r.pipelineWith(ctx, pipelineSpec{in: r.in, n: n, fwdWait: fwdWait})
	if err != nil {
		return Section{}, err
	}
	rate := res.consumed / 2
	before := &relayVariant{name: "before: one cut per transaction, its first page read apart, a 1 ms pause after each", serial: true}
	now := &relayVariant{name: "now: pipelined reads (defaults)"}
	var (
		roundRows [][]string
		ratios    []float64
	)
	for round := range rounds {
		order := []*relayVariant{before, now}
		if round%2 == 1 {
			order = []*relayVariant{now, before}
		}
		for _, v := range order {
			row, err := r.relayRound(ctx, o, v, liveN, rate, fwdWait)
			if err != nil {
				return Section{}, fmt.Errorf("relay steps: round %d, %s: %w", round+1, v.name, err)
			}
			roundRows = append(roundRows, append([]string{fmt.Sprint(round + 1)}, row...))
		}
		ratios = append(ratios, float64(now.p99[round])/float64(before.p99[round]))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "The outbox forwarder at half the consuming rate, profiled step by step: the end-to-end pipeline above (dedup "+
		"transaction writing a business row and an outbox row, forwarder with its defaults), its consuming rate measured first "+
		"by draining a backlog of %d events, then %d round(s) of %d events published at half that rate after %d warm-up events, "+
		"in each round the forwarder as it is and as it was before its reads were pipelined, order alternated. "+
		"The forwarder reports each step of its loop with its time to an observer that the bench passes in Run's context "+
		"(internal/relaystep: no exported API). **publish→Kafka** runs from the handler's publish to the outbox to the broker's "+
		"acknowledgement of the forwarded record; the target is a p99 of at most %s on a loaded 2-core machine. "+
		"The load column is /proc/loadavg (1, 5, 15 min) when the round started. p99 now / before, per round: **%s**.\n\n",
		n, rounds, liveN, warmupEvents, relayTarget, Summarise(ratios))
	b.WriteString(Table([]string{"round", "forwarder", "published (msg/s)", "load average", "publish→Kafka p50", "publish→Kafka p99", "p99 ≤ 20ms"}, roundRows))
	for _, v := range []*relayVariant{now, before} {
		fmt.Fprintf(&b, "\nEach forwarder transaction step by step, %s, over every round: how often the step ran, its p50 and p99, "+
			"and its total as a share of the rounds' forwarding time (BEGIN to COMMIT returned, plus the pauses and looks between; "+
			"a send and the position update run at the same time):\n\n", v.name)
		b.WriteString(Table([]string{"step", "count", "p50", "p99", "share of the time"}, stepRows(v.logs)))
		var txs, pages int
		for _, l := range v.logs {
			_, ps, _, t := l.replay()
			txs, pages = txs+t, pages+len(ps)
		}
		if txs > 0 {
			fmt.Fprintf(&b, "\n%d transactions committed, %d pages sent: %.2f pages per transaction.\n", txs, pages, float64(pages)/float64(txs))
		}
	}
	b.WriteString("\nEach measured row's publish→Kafka latency in parts, placed in the page whose send returned at its acknowledgement: " +
		"the writer's own transaction, the wait for the read that takes the row (a row committed after a cut's snapshot waits for the next read), " +
		"that read, the wait for the page before it, and the send. Mean and p50 over all rows, and the mean over the slowest 1 % " +
		"(the rows at or above the p99): where the p99 goes.\n\n")
	b.WriteString(Table([]string{"part", "now: mean", "now: p50", "now: slowest 1 %, mean", "before: mean", "before: slowest 1 %, mean"}, partRows(now.logs, before.logs)))
	return Section{Title: "Relay latency, step by step: where publish→Kafka time goes", Markdown: b.String()}, nil
}

// relayRound runs one paced round of v and returns its table row.
func (r *e2eRig) relayRound(ctx context.Context, o Options, v *relayVariant, n int, rate float64, fwdWait time.Duration) ([]string, error) {
	live, err := r.topic("bench-steps")
	if err != nil {
		return nil, err
	}
	l := newStepLog()
	load := loadAverage()
	res, err := r.pipelineWith(ctx, pipelineSpec{in: live, n: n, produceRate: rate, fwdWait: fwdWait,
		observe: l.observe, committed: l.commit, acked: l.ack, serial: v.serial})
	if err != nil {
		return nil, err
	}
	if !res.complete {
		return nil, fmt.Errorf("only %d of %d forwarded within %s", res.forwardedNum, n, fwdWait)
	}
	k50, k99 := percentile(res.toKafka, 0.50), percentile(res.toKafka, 0.99)
	met := "yes"
	if k99 > relayTarget {
		met = fmt.Sprintf("no (+%s)", fmtDur(k99-relayTarget))
	}
	o.Logf("  relay steps: %s at %.0f msg/s (load %s): publish→Kafka p50 %s p99 %s", v.name, rate, load, k50, k99)
	v.logs, v.p50, v.p99 = append(v.logs, l), append(v.p50, k50), append(v.p99, k99)
	return []string{v.name, fmt.Sprintf("%.0f", rate), load, fmtDur(k50), fmtDur(k99), met}, nil
}

func stepRows(logs []*stepLog) [][]string {
	all := map[string][]time.Duration{}
	for _, l := range logs {
		durs, _, _, _ := l.replay()
		for k, v := range durs {
			all[k] = append(all[k], v...)
		}
	}
	var total time.Duration
	for _, k := range []string{stepNames[7], stepNames[8], stepNames[9], stepNames[10]} {
		for _, d := range all[k] {
			total += d
		}
	}
	var rows [][]string
	for _, name := range stepNames {
		xs := all[name]
		var sum time.Duration
		for _, d := range xs {
			sum += d
		}
		share := "–"
		if total > 0 {
			share = fmt.Sprintf("%.0f%%", 100*float64(sum)/float64(total))
		}
		rows = append(rows, []string{name, fmt.Sprint(len(xs)), fmtDur(percentile(xs, 0.5)), fmtDur(percentile(xs, 0.99)), share})
	}
	return rows
}

// partRows returns the row-parts table: now's mean, p50 and slowest-1 %
// mean, then before's mean and slowest-1 % mean.
func partRows(now, before []*stepLog) [][]string {
	nowCols, beforeCols := partColumns(now), partColumns(before)
	var rows [][]string
	for i, name := range append(slices.Clone(rowParts), "publish→Kafka (the sum, pauses counted once)") {
		rows = append(rows, []string{name, nowCols[i][0], nowCols[i][1], nowCols[i][2], beforeCols[i][0], beforeCols[i][2]})
	}
	return rows
}

// partColumns returns, per row part and then the total, its mean and p50
// over all rows and its mean over the slowest 1 %.
func partColumns(logs []*stepLog) [][3]string {
	var totals []time.Duration
	var parts [][]time.Duration
	for _, l := range logs {
		t, p := l.rowBreakdown()
		totals, parts = append(totals, t...), append(parts, p...)
	}
	p99 := percentile(totals, 0.99)
	var out [][3]string
	for i := range len(rowParts) + 1 {
		var all, slow []time.Duration
		for j, ps := range parts {
			x := totals[j]
			if i < len(rowParts) {
				x = ps[i]
			}
			all = append(all, x)
			if totals[j] >= p99 {
				slow = append(slow, x)
			}
		}
		out = append(out, [3]string{fmtDur(meanDur(all)), fmtDur(percentile(all, 0.5)), fmtDur(meanDur(slow))})
	}
	return out
}

// loadAverage is /proc/loadavg's first three fields, or "n/a".
func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "n/a"
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return "n/a"
	}
	return strings.Join(f[:3], " ")
}
