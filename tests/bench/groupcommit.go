package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
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
	n, rounds, fwdWait := 6000, o.Rounds, 10*time.Second
	latRounds, latFor := max(1, o.Rounds/2), 2*time.Second
	if o.Short {
		n, rounds, fwdWait = 1500, 2, 5*time.Second
		latRounds, latFor = 1, time.Second
	}
	var rows, latRows, costRows [][]string
	for _, parts := range gcPartitions {
		modes := gcModes(parts)
		r, err := newE2ERigWith(ctx, o, n, parts, gcPoolConns)
		if err != nil {
			return Section{}, err
		}
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
				res, err := r.pipelineWith(ctx, pipelineSpec{in: r.in, n: n, fwdWait: fwdWait, groupCommit: m.cfg,
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
		rates, err := Rotate(rounds, variants...)
		if err != nil {
			r.close()
			return Section{}, err
		}
		for i, m := range modes[1:] {
			i++
			st := Summarise(Ratios(rates[0], rates[i]))
			fwdRatio := "–"
			if len(fwd[0]) == rounds && len(fwd[i]) == rounds {
				fwdRatio = Summarise(Ratios(fwd[0], fwd[i])).String()
			}
			target := "–"
			if parts == 32 {
				target = pass(st.Median >= 3)
			}
			o.Logf("  group-commit %d partitions, %s: single %s msg/s, group %s msg/s (mean group %s), ratio %s, forwarded %s",
				parts, m.name, fmtRate(rates[0]), fmtRate(rates[i]), median(sizes[i]), st, fwdRatio)
			rows = append(rows, []string{fmt.Sprint(parts), m.name, fmtRate(rates[0]), fmtRate(rates[i]), median(sizes[i]), st.String(), target, fwdRatio})
		}

		if parts == 32 {
			for i, m := range modes {
				c := costs[i]
				costRows = append(costRows, []string{m.name, fmtRate(rates[i]), fmtDur(c.inMW()), fmtDur(c.outside()),
					c.serverCPUPerMsg(), c.clientCPUPerMsg()})
			}
			// Latency: events published at a fixed rate while the pipeline
			// runs, each mode in turn; every message's time inside the
			// middleware (arrival to result: in group mode the gathering and
			// the handlers before it in its group, then the COMMIT).
			// A shorter MaxWait shortens the wait for a group that does
			// not fill (MaxWait/5 without a newcomer).
			latModes := append(slices.Clone(modes), gcMode{fmt.Sprintf("group, MaxMessages %d, MaxWait 1ms", parts/int32(gcDefaultConcurrency)),
				&idem.GroupCommitConfig{MaxMessages: int(parts) / gcDefaultConcurrency, MaxWait: time.Millisecond}})
			loads := []float64{200, Summarise(rates[0]).Median / 2}
			if o.Short {
				loads = loads[:1]
			}
			for _, rate := range loads {
				lat := make([]durations, len(latModes))
				latSizes := make([][]float64, len(latModes))
				count := max(100, int(rate*latFor.Seconds()))
				variants := make([]func() (float64, error), len(latModes))
				for i, m := range latModes {
					variants[i] = func() (float64, error) {
						topic, err := r.topic("bench-gc-live")
						if err != nil {
							return 0, err
						}
						res, err := r.pipelineWith(ctx, pipelineSpec{in: topic, n: count, produceRate: rate, poll: 10 * time.Millisecond, fwdWait: fwdWait,
							groupCommit: m.cfg, inMiddleware: lat[i].add})
						if err != nil {
							return 0, fmt.Errorf("latency at %.0f msg/s, %s: %w", rate, m.name, err)
						}
						latSizes[i] = append(latSizes[i], meanGroup(idem.Stats{}, res.stats))
						return 1, nil
					}
				}
				if _, err := Rotate(latRounds, variants...); err != nil {
					r.close()
					return Section{}, err
				}
				s50, s99 := percentile(lat[0].xs, 0.50), percentile(lat[0].xs, 0.99)
				for i, m := range latModes[1:] {
					i++
					g50, g99 := percentile(lat[i].xs, 0.50), percentile(lat[i].xs, 0.99)
					o.Logf("  group-commit latency at %.0f msg/s, %s: single p50 %s p99 %s, group p50 %s p99 %s (mean group %s)",
						rate, m.name, s50, s99, g50, g99, median(latSizes[i]))
					latRows = append(latRows, []string{fmt.Sprintf("%.0f", rate), m.name, fmtDur(s50), fmtDur(g50), fmtDur(g50 - s50),
						fmtDur(s99), fmtDur(g99), fmtDur(g99 - s99), median(latSizes[i])})
				}
			}
		}
		r.close()
	}

	var b strings.Builder
	b.WriteString(Table([]string{"partitions", "group mode", "single (msg/s, median)", "group (msg/s, median)", "mean group size",
		"ratio group/single, committed", "≥ 3×", "ratio group/single, forwarded and read back"}, rows))
	fmt.Fprintf(&b, "\nThe pipeline of the end-to-end section (Kafka → router → dedup → one business row + one outbox row → "+
		"forwarder → Kafka) at %d and %d partitions, one router (one message in flight per partition), in three modes: single (one transaction "+
		"per message), `Config.GroupCommit` at its defaults (MaxMessages %d, MaxWait %s, Concurrency %d), and with MaxMessages = partitions / "+
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
	return Section{Title: "Group commit end to end: one transaction per group vs one per message", Markdown: b.String()}, nil
}

// gcDBRig is the database part of the pipeline without Kafka: the handler
// writes one business row and one outbox row; single and group are the
// dedup middleware around it in either mode, plain the same handler in
// plain transactions of several messages each.
type gcDBRig struct {
	db      *DB
	rt      *rtcount.Counter
	ob      *outbox.Outbox
	topic   string
	table   deduplicator.TableConfig
	seq     int
	handler message.HandlerFunc
	msgs    atomic.Int64 // messages completed, by every mode
}

func newGCDBRig(ctx context.Context, o Options) (*gcDBRig, error) {
	rt := &rtcount.Counter{}
	db, err := NewDB(ctx, o, "gc", gcPoolConns, func(c *pgxpool.Config) {
		c.ConnConfig.DialFunc = rt.DialFunc()
		c.ConnConfig.RuntimeParams["application_name"] = c.ConnConfig.RuntimeParams["search_path"] // the schema: unique
		c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	})
	if err != nil {
		return nil, err
	}
	r := &gcDBRig{db: db, rt: rt, topic: "bench-gc"}
	fail := func(err error) (*gcDBRig, error) { db.Close(); return nil, err }
	table := deduplicator.TableConfig{Schema: db.Schema}
	if err := migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)); err != nil {
		return fail(err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE bench_order (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref text NOT NULL, amount bigint NOT NULL)"); err != nil {
		return fail(err)
	}
	if r.ob, err = outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{r.topic}}, nil); err != nil {
		return fail(err)
	}
	if err := migrate.Up(ctx, db.Pool, outbox.MigrationLine(r.ob.Config(), r.topic)); err != nil {
		return fail(err)
	}
	r.table = table
	r.handler = func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return nil, err
		}
		p, err := r.ob.PublisherFromContext(ctx)
		if err != nil {
			return nil, err
		}
		return nil, p.Publish(r.topic, message.NewMessage(watermill.NewUUID(), msg.Payload))
	}
	return r, nil
}

// measure runs run while counting its cost and sampling what the rig's
// server backends are doing.
func (r *gcDBRig) measure(ctx context.Context, run func() (float64, error)) (cost, map[string]float64, error) {
	ws, err := startWaitSampler(ctx, r.db.url, r.db.Schema, 2*time.Millisecond)
	if err != nil {
		return cost{}, nil, err
	}
	p, err := probe(ctx, r.db.Pool, r.rt)
	if err != nil {
		_, _ = ws.finish()
		return cost{}, nil, err
	}
	before := r.msgs.Load()
	_, runErr := run()
	c, err := p.since(ctx, r.msgs.Load()-before)
	waits, werr := ws.finish()
	return c, waits, errors.Join(runErr, err, werr)
}

// dedup returns a middleware in mode gc (nil: single) with a consumer
// group of its own.
func (r *gcDBRig) dedup(gc *idem.GroupCommitConfig) (*idem.Dedup, error) {
	r.seq++
	return idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: fmt.Sprintf("bench-%d", r.seq), Table: r.table, GroupCommit: gc}, nil)
}

// middleware runs fresh events through d's middleware on workers
// goroutines (one per simulated partition, each waiting for its message's
// result before the next, as watermill-kafka does) for dur.
func (r *gcDBRig) middleware(ctx context.Context, d *idem.Dedup, workers int, dur time.Duration) (float64, error) {
	h := d.Middleware(r.handler)
	return Drive(ctx, workers, dur, func(ctx context.Context, _ int) error {
		msg, _ := newEventMessage(ctx)
		if _, err := h(msg); err != nil {
			return err
		}
		r.msgs.Add(1)
		return nil
	})
}

// plainGroups runs the handler on fresh events in plain transactions
// (BEGIN; size × handler; COMMIT, no claim) on workers goroutines for dur,
// and returns messages per second. A fractional size alternates between
// its floor and ceiling so that the mean matches. With batchOutbox, the
// group's outbox rows are written by one INSERT before COMMIT instead of
// one per message.
func (r *gcDBRig) plainGroups(ctx context.Context, workers int, size float64, dur time.Duration, batchOutbox bool) (float64, error) {
	if size < 1 {
		size = 1
	}
	var msgs atomic.Int64
	var carry sync.Mutex
	frac := 0.0
	nextSize := func() int {
		carry.Lock()
		defer carry.Unlock()
		frac += size
		k := int(frac)
		frac -= float64(k)
		return k
	}
	start := time.Now()
	_, err := Drive(ctx, workers, dur, func(ctx context.Context, _ int) error {
		k := nextSize()
		if k == 0 {
			return nil
		}
		tx, err := r.db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() {
			if err := tx.Rollback(context.WithoutCancel(ctx)); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
				panic(err)
			}
		}()
		var out []*message.Message
		for range k {
			msg, id := newEventMessage(ctx)
			msg.SetContext(idemctx.With(ctx, &idemctx.Value{Tx: tx, EventID: id}))
			if !batchOutbox {
				if _, err := r.handler(msg); err != nil {
					return err
				}
				continue
			}
			if _, err := tx.Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
				return err
			}
			fwd := message.NewMessage(watermill.NewUUID(), msg.Payload)
			fwd.SetContext(msg.Context())
			out = append(out, fwd)
		}
		if len(out) > 0 {
			if err := r.ob.PublishInTx(ctx, tx, r.topic, out...); err != nil {
				return err
			}
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		msgs.Add(int64(k))
		r.msgs.Add(int64(k))
		return nil
	})
	if err != nil {
		return 0, err
	}
	return float64(msgs.Load()) / time.Since(start).Seconds(), nil
}

// gcDBPartitions are the partition counts of the database-only section:
// those of the end-to-end one, and 128 (a group of 32 in each of 4
// connections, the shape of pgbench figures).
var gcDBPartitions = []int32{8, 32, 128}

func groupCommitCeiling(ctx context.Context, o Options) (Section, error) {
	r, err := newGCDBRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.db.Close()
	rounds, dur := 2*o.Rounds, measureFor(o, 250*time.Millisecond, 120*time.Millisecond)
	costDur, warm := measureFor(o, time.Second, 300*time.Millisecond), measureFor(o, 300*time.Millisecond, 150*time.Millisecond)

	type variant struct {
		name    string
		cfg     *idem.GroupCommitConfig // nil: single mode
		d       *idem.Dedup
		sizes   []float64
		ceiling bool // also measure its plain-transaction ceiling
	}
	var rows, costRows [][]string
	for _, parts := range gcDBPartitions {
		w := int(parts)
		var vs []*variant
		for i, m := range gcModes(parts) {
			vs = append(vs, &variant{name: m.name, cfg: m.cfg, ceiling: i > 0})
		}
		if parts == 32 {
			// Other splits of the 32 messages in flight.
			for _, c := range []int{2, 8} {
				vs = append(vs, &variant{name: fmt.Sprintf("group, MaxMessages %d, Concurrency %d", w/c, c), cfg: &idem.GroupCommitConfig{MaxMessages: w / c, Concurrency: c}})
			}
		}
		for _, v := range vs {
			if v.d, err = r.dedup(v.cfg); err != nil {
				return Section{}, err
			}
			// Warm the connections up and learn the group size.
			before := v.d.Stats()
			if _, err := r.middleware(ctx, v.d, w, warm); err != nil {
				return Section{}, err
			}
			v.sizes = []float64{meanGroup(before, v.d.Stats())}
		}
		// plainWorkers is how many plain transactions of size run at once:
		// as many as the messages in flight fill, at most Concurrency.
		plainWorkers := func(v *variant, size float64) int {
			c := v.cfg.Concurrency
			if c == 0 {
				c = gcDefaultConcurrency
			}
			return min(c, max(1, int(float64(w)/size+0.5)))
		}
		var runs []func() (float64, error)
		runOf := make([]int, len(vs)) // variant index → index in runs
		plainOf := map[int]int{}      // variant index → index of its ceiling in runs
		for i, v := range vs {
			runOf[i] = len(runs)
			runs = append(runs, func() (float64, error) {
				before := v.d.Stats()
				rate, err := r.middleware(ctx, v.d, w, dur)
				if v.cfg != nil {
					v.sizes = append(v.sizes, meanGroup(before, v.d.Stats()))
				}
				return rate, err
			})
			if v.ceiling {
				plainOf[i] = len(runs)
				runs = append(runs, func() (float64, error) {
					// The same messages in flight cut into groups of the
					// size last measured in this mode.
					size := v.sizes[len(v.sizes)-1]
					return r.plainGroups(ctx, plainWorkers(v, size), size, dur, false)
				})
			}
		}
		rates, err := Rotate(rounds, runs...)
		if err != nil {
			return Section{}, err
		}
		single := rates[runOf[0]]
		rows = append(rows, []string{fmt.Sprint(w), vs[0].name, fmtRate(single), "–", "1", "–", "–"})
		for i, v := range vs[1:] {
			i++
			mine := rates[runOf[i]]
			overSingle := Summarise(Ratios(single, mine))
			ceil, ok := "–", "–"
			if j, has := plainOf[i]; has {
				st := Summarise(Ratios(rates[j], mine))
				ceil, ok = fmt.Sprintf("%s (plain: %s msg/s)", st, fmtRate(rates[j])), pass(st.Median >= 0.8)
			}
			o.Logf("  group-commit-ceiling %d workers, %s: %s msg/s (mean group %s), ratio to single %s, to plain %s",
				w, v.name, fmtRate(mine), median(v.sizes[1:]), overSingle, ceil)
			rows = append(rows, []string{fmt.Sprint(w), v.name, fmtRate(mine), median(v.sizes[1:]), overSingle.String(), ceil, ok})
		}

		if parts == 8 {
			continue
		}
		// Where the time goes: each mode once more, alone, counting round
		// trips, WAL flushes and CPU, and sampling what the backends do.
		tuned := vs[2]
		size := Summarise(tuned.sizes[1:]).Median
		costRuns := []struct {
			name string
			run  func() (float64, error)
		}{
			{vs[0].name, func() (float64, error) { return r.middleware(ctx, vs[0].d, w, costDur) }},
			{vs[1].name, func() (float64, error) { return r.middleware(ctx, vs[1].d, w, costDur) }},
			{tuned.name, func() (float64, error) { return r.middleware(ctx, tuned.d, w, costDur) }},
			{fmt.Sprintf("plain, one message per transaction (%d at once)", w), func() (float64, error) { return r.plainGroups(ctx, w, 1, costDur, false) }},
			{fmt.Sprintf("plain, groups of %.0f (%d at once)", size, plainWorkers(tuned, size)), func() (float64, error) {
				return r.plainGroups(ctx, plainWorkers(tuned, size), size, costDur, false)
			}},
			{fmt.Sprintf("plain, groups of %.0f, the group's outbox rows in one INSERT", size), func() (float64, error) {
				return r.plainGroups(ctx, plainWorkers(tuned, size), size, costDur, true)
			}},
		}
		for _, cr := range costRuns {
			c, waits, err := r.measure(ctx, cr.run)
			if err != nil {
				return Section{}, fmt.Errorf("%s: %w", cr.name, err)
			}
			wal := waits["LWLock:WALWrite"] + waits["IO:WALSync"] + waits["IO:WALWrite"] + waits["LWLock:WALInsert"]
			other := 0.0
			for k, v := range waits {
				if k != "CPU" && k != "client" && k != "LWLock:WALWrite" && k != "IO:WALSync" && k != "IO:WALWrite" && k != "LWLock:WALInsert" {
					other += v
				}
			}
			o.Logf("  group-commit-ceiling cost %d, %s: %.0f msg/s, %.2f round trips, server %s, client %s per message; backends %v",
				w, cr.name, float64(c.msgs)/c.wall.Seconds(), c.per(float64(c.roundTrips)), c.serverCPUPerMsg(), c.clientCPUPerMsg(), waits)
			costRows = append(costRows, []string{fmt.Sprint(w), cr.name, c.perMsg(c.roundTrips, "%.2f"),
				c.serverCPUPerMsg(), c.clientCPUPerMsg(),
				fmt.Sprintf("%.1f", waits["CPU"]), fmt.Sprintf("%.1f", wal), fmt.Sprintf("%.1f", other), fmt.Sprintf("%.1f", waits["client"])})
		}
	}
	// A lone message: one worker, so no group ever gets a second message;
	// the modes interleaved call by call.
	lone := []gcMode{{"single", nil}, {"group, MaxWait 5ms (default)", &idem.GroupCommitConfig{}},
		{"group, MaxWait 1ms", &idem.GroupCommitConfig{MaxWait: time.Millisecond}},
		{"group, MaxWait 100µs", &idem.GroupCommitConfig{MaxWait: 100 * time.Microsecond}},
		{"group, MaxMessages 1 (no gathering)", &idem.GroupCommitConfig{MaxMessages: 1}}}
	var loneOps []func(context.Context) error
	for _, m := range lone {
		d, err := r.dedup(m.cfg)
		if err != nil {
			return Section{}, err
		}
		h := d.Middleware(r.handler)
		loneOps = append(loneOps, func(ctx context.Context) error {
			msg, _ := newEventMessage(ctx)
			_, err := h(msg)
			return err
		})
	}
	loneRounds, loneDur := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	loneRates, err := Interleave(ctx, loneRounds, 1, loneDur, loneOps...)
	if err != nil {
		return Section{}, err
	}
	var loneRows [][]string
	for i, m := range lone {
		mean := time.Duration(float64(time.Second) / Summarise(loneRates[i]).Median)
		added := "–"
		if i > 0 {
			added = fmtDur(mean - time.Duration(float64(time.Second)/Summarise(loneRates[0]).Median))
		}
		o.Logf("  group-commit-ceiling lone message, %s: %s per message", m.name, mean)
		loneRows = append(loneRows, []string{m.name, fmtDur(mean), added, Summarise(Ratios(loneRates[i], loneRates[0])).String()})
	}

	var b strings.Builder
	b.WriteString(Table([]string{"partitions (workers)", "mode", "msg/s (median)", "mean group size", "ratio to single", "ratio to plain transactions of the same groups (ceiling)", "≥ 0.8"}, rows))
	fmt.Fprintf(&b, "\nThe database part alone, without Kafka, to isolate it: one goroutine per partition hands fresh events to the middleware one "+
		"at a time, each waiting for its message's result before the next (as watermill-kafka does per partition); the handler writes one "+
		"business row and one outbox row (`outbox.PublisherFromContext`). Modes as in the section above; at 32 partitions also two other "+
		"splits of the 32 messages in flight. Ceiling (plain): the same business writes cut into groups of the mean size just measured in "+
		"that mode, each group one plain transaction (BEGIN; business row + outbox row per message; COMMIT: no claim, no gathering), "+
		"as many transactions at once as the messages in flight fill (partitions / group size, at most Concurrency). "+
		"Pool of %d connections. %d rounds of %s, order rotated each round; ratios are of the same round.\n\n", gcPoolConns, rounds, dur)
	fmt.Fprintf(&b, "Where the time goes: each mode run once more for %s, alone (its throughput then is not comparable: the table above is). Round trips are counted at the net.Conn level; CPU per message is the rig's PostgreSQL backends' (from /proc) and this "+
		"process's; the last four columns are the mean number of the rig's backends, sampled every 2 ms from `pg_stat_activity`, that are "+
		"running (no wait event), waiting on the WAL (WALWrite, WALSync, WALInsert: another backend's flush or their own), waiting on anything "+
		"else (locks, buffers), and idle in a transaction, i.e. waiting for the client. The last row is not something the middleware does: "+
		"it shows what writing the outbox rows of a group in one statement would save.\n\n", costDur)
	b.WriteString(Table([]string{"partitions", "mode", "round trips per message", "server CPU per message",
		"client CPU per message", "backends running", "backends waiting on WAL", "backends waiting on other", "backends waiting for the client"}, costRows))
	fmt.Fprintf(&b, "\nA lone message (one worker: nothing ever joins its group), the modes interleaved call by call, %d rounds of %s; "+
		"time per message (median over rounds), its excess over single mode, and the ratio of times. A group that nobody joins runs after "+
		"MaxWait/5 unless it already holds its share of the messages in flight, which a lone message always does, so it runs at once "+
		"(without that rule it waited the gap, at least about 1 ms: Go's Linux netpoller sleeps in whole milliseconds):\n\n", loneRounds, loneDur)
	b.WriteString(Table([]string{"mode", "time per message", "added", "time / single's"}, loneRows))
	return Section{Title: "Group commit against its ceiling: the database part alone", Markdown: b.String()}, nil
}
