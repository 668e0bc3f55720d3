package bench

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() {
	Register("group-commit", groupCommitE2E)
	Register("group-commit-ceiling", groupCommitCeiling)
}

// gcPartitions are the partition counts of the group-commit sections.
var gcPartitions = []int32{8, 32}

// gcPoolConns is the pool size of the group-commit rigs, the same in every
// mode: enough for one transaction per partition at 32 partitions in single
// mode, plus the forwarder.
const gcPoolConns = 40

// gcMode is one way of running the middleware: cfg nil is single mode.
// The defaults of idem.GroupCommitConfig (its field docs), for the
// arithmetic and the description of the modes.
const (
	gcDefaultMaxMessages = 64
	gcDefaultMaxWait     = 5 * time.Millisecond
	gcDefaultConcurrency = 4
)

type gcMode struct {
	name string
	cfg  *idem.GroupCommitConfig
}

// gcModes are the modes compared at a partition count: single, group
// commit at its defaults, and group commit with MaxMessages = partitions /
// Concurrency, so that the partitions' messages in flight fill Concurrency
// groups at once.
func gcModes(parts int32) []gcMode {
	c := gcDefaultConcurrency
	m := max(1, int(parts)/c)
	return []gcMode{
		{"single", nil},
		{"group, defaults", &idem.GroupCommitConfig{}},
		{fmt.Sprintf("group, MaxMessages %d", m), &idem.GroupCommitConfig{MaxMessages: m}},
	}
}

// meanGroup is the mean group size between two snapshots of the counters.
func meanGroup(before, after idem.Stats) float64 {
	if g := after.Groups - before.Groups; g > 0 {
		return float64(after.GroupedMessages-before.GroupedMessages) / float64(g)
	}
	return 0
}

// durations collects per-message times from concurrent goroutines.
type durations struct {
	mu sync.Mutex
	xs []time.Duration
}

func (d *durations) add(x time.Duration) {
	d.mu.Lock()
	d.xs = append(d.xs, x)
	d.mu.Unlock()
}

func fmtDur(d time.Duration) string {
	neg := d < 0
	if neg {
		d = -d
	}
	switch {
	case d >= 10*time.Millisecond:
		d = d.Round(100 * time.Microsecond)
	case d >= time.Millisecond:
		d = d.Round(10 * time.Microsecond)
	default:
		d = d.Round(time.Microsecond)
	}
	if neg {
		return "−" + d.String()
	}
	return d.String()
}

// e2eCost accumulates a mode's cost over rounds.
type e2eCost struct {
	cost
	inMWSum, cycleSum time.Duration
	rounds            int
}

func (c *e2eCost) add(x cost, inMW, cycle time.Duration) {
	c.cost = c.cost.plus(x)
	c.inMWSum += inMW
	c.cycleSum += cycle
	c.rounds++
}

func (c *e2eCost) inMW() time.Duration {
	if c.rounds == 0 {
		return 0
	}
	return c.inMWSum / time.Duration(c.rounds)
}

func (c *e2eCost) outside() time.Duration {
	if c.rounds == 0 {
		return 0
	}
	return (c.cycleSum - c.inMWSum) / time.Duration(c.rounds)
}

func median(xs []float64) string { return fmt.Sprintf("%.1f", Summarise(xs).Median) }

func groupCommitE2E(ctx context.Context, o Options) (Section, error) {
	g := gcE2ERun{o: o, n: 6000, rounds: o.Rounds, fwdWait: 10 * time.Second, latRounds: max(1, o.Rounds/2), latFor: 2 * time.Second}
	if o.Short {
		g.n, g.rounds, g.fwdWait = 1500, 2, 5*time.Second
		g.latRounds, g.latFor = 1, time.Second
	}
	for _, parts := range gcPartitions {
		r, err := newE2ERigWith(ctx, o, g.n, parts, gcPoolConns)
		if err != nil {
			return Section{}, err
		}
		err = g.atPartitions(ctx, r, parts)
		r.close()
		if err != nil {
			return Section{}, err
		}
	}
	return Section{Title: "Group commit end to end: one transaction per group vs one per message", Markdown: g.markdown()}, nil
}

// gcE2ERun is one run of the group-commit section: its sizes and the
// rows of its tables.
type gcE2ERun struct {
	o                       Options
	n, rounds, latRounds    int
	fwdWait, latFor         time.Duration
	rows, latRows, costRows [][]string
}

// atPartitions measures the modes at parts partitions on r: throughput,
// and at 32 partitions where the time goes and the latency gathering adds.
func (g *gcE2ERun) atPartitions(ctx context.Context, r *e2eRig, parts int32) error {
	modes := gcModes(parts)
	rates, costs, err := g.throughput(ctx, r, parts, modes)
	if err != nil || parts != 32 {
		return err
	}
	for i, m := range modes {
		c := costs[i]
		g.costRows = append(g.costRows, []string{m.name, fmtRate(rates[i]), fmtDur(c.inMW()), fmtDur(c.outside()),
			c.serverCPUPerMsg(), c.clientCPUPerMsg()})
	}
	return g.latency(ctx, r, parts, modes, Summarise(rates[0]).Median)
}

// throughput drains a backlog of n events in each mode, rotated over the
// rounds, adds the throughput table's rows and returns each mode's rates
// and costs.
func (g *gcE2ERun) throughput(ctx context.Context, r *e2eRig, parts int32, modes []gcMode) ([][]float64, []e2eCost, error) {
	n := g.n
	sizes := make([][]float64, len(modes))
	fwd := make([][]float64, len(modes))
	costs := make([]e2eCost, len(modes))
	variants := make([]func() (float64, error), len(modes))
	for i, m := range modes {
		variants[i] = func() (float64, error) {
			p, err := probe(ctx, r.db.Pool, nil)
			if err != nil {
				return 0, err
			}
			var inMW atomic.Int64
			res, err := r.pipelineWith(ctx, pipelineSpec{in: r.in, n: n, fwdWait: g.fwdWait, groupCommit: m.cfg,
				inMiddleware: func(d time.Duration) { inMW.Add(int64(d)) }})
			if err != nil {
				return 0, fmt.Errorf("%d partitions, %s: %w", parts, m.name, err)
			}
			c, err := p.since(ctx, int64(n))
			if err != nil {
				return 0, err
			}
			costs[i].add(c, time.Duration(inMW.Load()/int64(n)), time.Duration(float64(parts)/res.consumed*float64(time.Second)))
			if s := res.stats; s.GroupFallbacks != 0 || s.Alone != 0 || s.Failed != 0 {
				return 0, fmt.Errorf("%d partitions, %s: %d failed, %d group fallbacks, %d alone in a run without faults", parts, m.name, s.Failed, s.GroupFallbacks, s.Alone)
			}
			sizes[i] = append(sizes[i], meanGroup(idem.Stats{}, res.stats))
			if res.complete {
				fwd[i] = append(fwd[i], res.forwarded)
			}
			return res.consumed, nil
		}
	}
	rates, err := Rotate(g.rounds, variants...)
	if err != nil {
		return nil, nil, err
	}
	for i, m := range modes[1:] {
		i++
		st := Summarise(Ratios(rates[0], rates[i]))
		fwdRatio := "–"
		if len(fwd[0]) == g.rounds && len(fwd[i]) == g.rounds {
			fwdRatio = Summarise(Ratios(fwd[0], fwd[i])).String()
		}
		target := "–"
		if parts == 32 {
			target = pass(st.Median >= 3)
		}
		g.o.Logf("  group-commit %d partitions, %s: single %s msg/s, group %s msg/s (mean group %s), ratio %s, forwarded %s",
			parts, m.name, fmtRate(rates[0]), fmtRate(rates[i]), median(sizes[i]), st, fwdRatio)
		g.rows = append(g.rows, []string{fmt.Sprint(parts), m.name, fmtRate(rates[0]), fmtRate(rates[i]), median(sizes[i]), st.String(), target, fwdRatio})
	}
	return rates, costs, nil
}

// latency publishes events at a fixed rate while the pipeline runs, each
// mode in turn, and adds the latency table's rows: every message's time
// inside the middleware (arrival to result: in group mode the gathering
// and the handlers before it in its group, then the COMMIT). A shorter
// MaxWait shortens the wait for a group that does not fill (MaxWait/5
// without a newcomer). single is single mode's median rate.
func (g *gcE2ERun) latency(ctx context.Context, r *e2eRig, parts int32, modes []gcMode, single float64) error {
	latModes := append(slices.Clone(modes), gcMode{fmt.Sprintf("group, MaxMessages %d, MaxWait 1ms", parts/int32(gcDefaultConcurrency)),
		&idem.GroupCommitConfig{MaxMessages: int(parts) / gcDefaultConcurrency, MaxWait: time.Millisecond}})
	loads := []float64{200, single / 2}
	if g.o.Short {
		loads = loads[:1]
	}
	for _, rate := range loads {
		lat := make([]durations, len(latModes))
		latSizes := make([][]float64, len(latModes))
		count := max(100, int(rate*g.latFor.Seconds()))
		variants := make([]func() (float64, error), len(latModes))
		for i, m := range latModes {
			variants[i] = func() (float64, error) {
				topic, err := r.topic("bench-gc-live")
				if err != nil {
					return 0, err
				}
				res, err := r.pipelineWith(ctx, pipelineSpec{in: topic, n: count, produceRate: rate, poll: 10 * time.Millisecond, fwdWait: g.fwdWait,
					groupCommit: m.cfg, inMiddleware: lat[i].add})
				if err != nil {
					return 0, fmt.Errorf("latency at %.0f msg/s, %s: %w", rate, m.name, err)
				}
				latSizes[i] = append(latSizes[i], meanGroup(idem.Stats{}, res.stats))
				return 1, nil
			}
		}
		if _, err := Rotate(g.latRounds, variants...); err != nil {
			return err
		}
		s50, s99 := percentile(lat[0].xs, 0.50), percentile(lat[0].xs, 0.99)
		for i, m := range latModes[1:] {
			i++
			g50, g99 := percentile(lat[i].xs, 0.50), percentile(lat[i].xs, 0.99)
			g.o.Logf("  group-commit latency at %.0f msg/s, %s: single p50 %s p99 %s, group p50 %s p99 %s (mean group %s)",
				rate, m.name, s50, s99, g50, g99, median(latSizes[i]))
			g.latRows = append(g.latRows, []string{fmt.Sprintf("%.0f", rate), m.name, fmtDur(s50), fmtDur(g50), fmtDur(g50 - s50),
				fmtDur(s99), fmtDur(g99), fmtDur(g99 - s99), median(latSizes[i])})
		}
	}
	return nil
}

// markdown is the section's text: its three tables and what they measure.
func (g *gcE2ERun) markdown() string {
	rows, costRows, latRows := g.rows, g.costRows, g.latRows
	n, rounds, latRounds, latFor := g.n, g.rounds, g.latRounds, g.latFor
	var b strings.Builder
	b.WriteString(Table([]string{"partitions", "group mode", "single (msg/s, median)", "group (msg/s, median)", "mean group size",
		"ratio group/single, committed", "≥ 3×", "ratio group/single, forwarded and read back"}, rows))
	fmt.Fprintf(&b, "\nThe pipeline of the end-to-end section (Kafka → router → dedup → one business row + one outbox row → "+
		"forwarder → Kafka) at %d and %d partitions, one router (one message in flight per partition), in three modes: single (one transaction "+
		"per message), `Config.Mode = &GroupCommitConfig{}` at its defaults (MaxMessages %d, MaxWait %s, Concurrency %d), and with MaxMessages = partitions / "+
		"Concurrency. Pool of %d connections in every mode. Each round drains a backlog of %d events with a new consumer group; %d rounds, "+
		"the modes' order rotated each round; ratio = group / single of the same round; rates from the first handled event to the last "+
		"committed one, or to the last forwarded record read back. Mean group size = GroupedMessages / Groups of the middleware's Stats.\n\n",
		gcPartitions[0], gcPartitions[1], gcDefaultMaxMessages, gcDefaultMaxWait, gcDefaultConcurrency, gcPoolConns, n, rounds)
	fmt.Fprintf(&b, "Where the time goes at 32 partitions (totals over the same rounds). Each partition has one message in flight, so "+
		"msg/s = 32 / (time in the middleware + time outside it per message: the ack, the offset, the next message through Sarama and the "+
		"router, with the broker in the same process). CPU per message is the pipeline's whole share: server = the PostgreSQL backends of "+
		"the rig's pool (dedup and forwarder), client = this process (router, middleware, pgx, forwarder, the in-process broker and the "+
		"reader of the forwarded topic), both read from /proc:\n\n")
	b.WriteString(Table([]string{"mode", "msg/s (median)", "mean time in the middleware", "mean time outside it",
		"server CPU per message", "client CPU per message"}, costRows))
	fmt.Fprintf(&b, "\nLatency added by gathering, at 32 partitions: events published at a fixed rate for %s per run while the pipeline runs; "+
		"each message's time inside the dedup middleware, from its arrival to its result (in group mode: waiting for the group to gather "+
		"and for a free slot, the handlers before it in its group, the COMMIT); %d run(s) per mode, rotated, all runs pooled. "+
		"\"added\" is the group mode's percentile minus single mode's. A group runs when it holds its share of the messages in flight "+
		"(ceil(in flight / Concurrency), at most MaxMessages), at MaxWait, or when no message joined it for MaxWait/5; a lone message "+
		"is its own share and runs at once:\n\n", latFor, latRounds)
	b.WriteString(Table([]string{"published (msg/s)", "group mode", "p50 single", "p50 group", "p50 added", "p99 single", "p99 group", "p99 added", "mean group size"}, latRows))
	return b.String()
}
