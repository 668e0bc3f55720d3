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
	return idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: fmt.Sprintf("bench-%d", r.seq), Table: r.table, Mode: gc}, nil)
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
// gcDBPartitions are the partition counts (workers) of the ceiling section.
var gcDBPartitions = []int32{8, 32, 128}

func groupCommitCeiling(ctx context.Context, o Options) (Section, error) {
	r, err := newGCDBRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.db.Close()
	c := gcCeilingRun{r: r, o: o, rounds: 2 * o.Rounds, dur: measureFor(o, 250*time.Millisecond, 120*time.Millisecond),
		costDur: measureFor(o, time.Second, 300*time.Millisecond), warm: measureFor(o, 300*time.Millisecond, 150*time.Millisecond)}
	var rows, costRows [][]string
	for _, parts := range gcDBPartitions {
		vs, err := c.variants(ctx, parts)
		if err != nil {
			return Section{}, err
		}
		more, err := c.throughput(ctx, int(parts), vs)
		if err != nil {
			return Section{}, err
		}
		rows = append(rows, more...)
		if parts == 8 {
			continue
		}
		more, err = c.costs(ctx, int(parts), vs)
		if err != nil {
			return Section{}, err
		}
		costRows = append(costRows, more...)
	}
	loneRows, err := c.loneMessage(ctx)
	if err != nil {
		return Section{}, err
	}
	return Section{Title: "Group commit against its ceiling: the database part alone", Markdown: c.markdown(rows, costRows, loneRows)}, nil
}

// gcCeilingRun is one run of the ceiling section: its rig and durations.
type gcCeilingRun struct {
	r      *gcDBRig
	o      Options
	rounds int
	// dur is a measured run's length, costDur a cost run's, warm the
	// warm-up's.
	dur, costDur, warm time.Duration
	// loneRounds and loneDur are the lone message's rounds and their length.
	loneRounds int
	loneDur    time.Duration
}

// gcVariant is one mode of the middleware measured by the ceiling section.
type gcVariant struct {
	name    string
	cfg     *idem.GroupCommitConfig // nil: single mode
	d       *idem.Dedup
	sizes   []float64
	ceiling bool // also measure its plain-transaction ceiling
}

// plainWorkers is how many plain transactions of size run at once for v
// at w messages in flight: as many as they fill, at most Concurrency.
func (v *gcVariant) plainWorkers(w int, size float64) int {
	c := v.cfg.Concurrency
	if c == 0 {
		c = gcDefaultConcurrency
	}
	return min(c, max(1, int(float64(w)/size+0.5)))
}

// variants are the modes measured at parts workers (at 32, also other
// splits of the 32 messages in flight), each warmed up once, which learns
// its group size.
func (c *gcCeilingRun) variants(ctx context.Context, parts int32) ([]*gcVariant, error) {
	w := int(parts)
	var vs []*gcVariant
	for i, m := range gcModes(parts) {
		vs = append(vs, &gcVariant{name: m.name, cfg: m.cfg, ceiling: i > 0})
	}
	if parts == 32 {
		for _, k := range []int{2, 8} {
			vs = append(vs, &gcVariant{name: fmt.Sprintf("group, MaxMessages %d, Concurrency %d", w/k, k), cfg: &idem.GroupCommitConfig{MaxMessages: w / k, Concurrency: k}})
		}
	}
	for _, v := range vs {
		var err error
		if v.d, err = c.r.dedup(v.cfg); err != nil {
			return nil, err
		}
		// Warm the connections up and learn the group size.
		before := v.d.Stats()
		if _, err := c.r.middleware(ctx, v.d, w, c.warm); err != nil {
			return nil, err
		}
		v.sizes = []float64{meanGroup(before, v.d.Stats())}
	}
	return vs, nil
}

// throughput measures vs at w workers, rotated over the rounds, each
// group mode with its plain-transaction ceiling when it has one, and
// returns the table's rows.
func (c *gcCeilingRun) throughput(ctx context.Context, w int, vs []*gcVariant) ([][]string, error) {
	r := c.r
	var runs []func() (float64, error)
	runOf := make([]int, len(vs)) // variant index → index in runs
	plainOf := map[int]int{}      // variant index → index of its ceiling in runs
	for i, v := range vs {
		runOf[i] = len(runs)
		runs = append(runs, func() (float64, error) {
			before := v.d.Stats()
			rate, err := r.middleware(ctx, v.d, w, c.dur)
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
				return r.plainGroups(ctx, v.plainWorkers(w, size), size, c.dur, false)
			})
		}
	}
	rates, err := Rotate(c.rounds, runs...)
	if err != nil {
		return nil, err
	}
	single := rates[runOf[0]]
	rows := [][]string{{fmt.Sprint(w), vs[0].name, fmtRate(single), "–", "1", "–", "–"}}
	for i, v := range vs[1:] {
		i++
		mine := rates[runOf[i]]
		overSingle := Summarise(Ratios(single, mine))
		ceil, ok := "–", "–"
		if j, has := plainOf[i]; has {
			st := Summarise(Ratios(rates[j], mine))
			ceil, ok = fmt.Sprintf("%s (plain: %s msg/s)", st, fmtRate(rates[j])), pass(st.Median >= 0.8)
		}
		c.o.Logf("  group-commit-ceiling %d workers, %s: %s msg/s (mean group %s), ratio to single %s, to plain %s",
			w, v.name, fmtRate(mine), median(v.sizes[1:]), overSingle, ceil)
		rows = append(rows, []string{fmt.Sprint(w), v.name, fmtRate(mine), median(v.sizes[1:]), overSingle.String(), ceil, ok})
	}
	return rows, nil
}

// gcWALWaits are the wait events of pg_stat_activity counted as waiting
// on the WAL.
var gcWALWaits = []string{"LWLock:WALWrite", "IO:WALSync", "IO:WALWrite", "LWLock:WALInsert"}

// costs runs each mode once more, alone, at w workers, counting round
// trips, WAL flushes and CPU, and sampling what the backends do; it
// returns the cost table's rows.
func (c *gcCeilingRun) costs(ctx context.Context, w int, vs []*gcVariant) ([][]string, error) {
	r, costDur := c.r, c.costDur
	tuned := vs[2]
	size := Summarise(tuned.sizes[1:]).Median
	workers := tuned.plainWorkers(w, size)
	costRuns := []struct {
		name string
		run  func() (float64, error)
	}{
		{vs[0].name, func() (float64, error) { return r.middleware(ctx, vs[0].d, w, costDur) }},
		{vs[1].name, func() (float64, error) { return r.middleware(ctx, vs[1].d, w, costDur) }},
		{tuned.name, func() (float64, error) { return r.middleware(ctx, tuned.d, w, costDur) }},
		{fmt.Sprintf("plain, one message per transaction (%d at once)", w), func() (float64, error) { return r.plainGroups(ctx, w, 1, costDur, false) }},
		{fmt.Sprintf("plain, groups of %.0f (%d at once)", size, workers), func() (float64, error) {
			return r.plainGroups(ctx, workers, size, costDur, false)
		}},
		{fmt.Sprintf("plain, groups of %.0f, the group's outbox rows in one INSERT", size), func() (float64, error) {
			return r.plainGroups(ctx, workers, size, costDur, true)
		}},
	}
	var rows [][]string
	for _, cr := range costRuns {
		k, waits, err := r.measure(ctx, cr.run)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", cr.name, err)
		}
		wal, other := 0.0, 0.0
		for name, v := range waits {
			switch {
			case slices.Contains(gcWALWaits, name):
				wal += v
			case name != "CPU" && name != "client":
				other += v
			}
		}
		c.o.Logf("  group-commit-ceiling cost %d, %s: %.0f msg/s, %.2f round trips, server %s, client %s per message; backends %v",
			w, cr.name, float64(k.msgs)/k.wall.Seconds(), k.per(float64(k.roundTrips)), k.serverCPUPerMsg(), k.clientCPUPerMsg(), waits)
		rows = append(rows, []string{fmt.Sprint(w), cr.name, k.perMsg(k.roundTrips, "%.2f"),
			k.serverCPUPerMsg(), k.clientCPUPerMsg(),
			fmt.Sprintf("%.1f", waits["CPU"]), fmt.Sprintf("%.1f", wal), fmt.Sprintf("%.1f", other), fmt.Sprintf("%.1f", waits["client"])})
	}
	return rows, nil
}

// loneMessage times a lone message in each mode: one worker, so no group
// ever gets a second message; the modes interleaved call by call. It
// returns the table's rows.
func (c *gcCeilingRun) loneMessage(ctx context.Context) ([][]string, error) {
	lone := []gcMode{{"single", nil}, {"group, MaxWait 5ms (default)", &idem.GroupCommitConfig{}},
		{"group, MaxWait 1ms", &idem.GroupCommitConfig{MaxWait: time.Millisecond}},
		{"group, MaxWait 100µs", &idem.GroupCommitConfig{MaxWait: 100 * time.Microsecond}},
		{"group, MaxMessages 1 (no gathering)", &idem.GroupCommitConfig{MaxMessages: 1}}}
	var loneOps []func(context.Context) error
	for _, m := range lone {
		d, err := c.r.dedup(m.cfg)
		if err != nil {
			return nil, err
		}
		h := d.Middleware(c.r.handler)
		loneOps = append(loneOps, func(ctx context.Context) error {
			msg, _ := newEventMessage(ctx)
			_, err := h(msg)
			return err
		})
	}
	c.loneRounds, c.loneDur = 2*c.o.Rounds, measureFor(c.o, 400*time.Millisecond, 150*time.Millisecond)
	loneRates, err := Interleave(ctx, c.loneRounds, 1, c.loneDur, loneOps...)
	if err != nil {
		return nil, err
	}
	var rows [][]string
	for i, m := range lone {
		mean := time.Duration(float64(time.Second) / Summarise(loneRates[i]).Median)
		added := "–"
		if i > 0 {
			added = fmtDur(mean - time.Duration(float64(time.Second)/Summarise(loneRates[0]).Median))
		}
		c.o.Logf("  group-commit-ceiling lone message, %s: %s per message", m.name, mean)
		rows = append(rows, []string{m.name, fmtDur(mean), added, Summarise(Ratios(loneRates[i], loneRates[0])).String()})
	}
	return rows, nil
}

// markdown is the section's text: its three tables and what they measure.
func (c *gcCeilingRun) markdown(rows, costRows, loneRows [][]string) string {
	rounds, dur, costDur, loneRounds, loneDur := c.rounds, c.dur, c.costDur, c.loneRounds, c.loneDur
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
		"else (locks, buffers), and idle in a transaction, i.e. waiting for the client. The last row is plain transactions whose outbox rows "+
		"are one INSERT per group, as group commit gathers them (the handler's `PublisherFromContext` rows join one INSERT before COMMIT).\n\n", costDur)
	b.WriteString(Table([]string{"partitions", "mode", "round trips per message", "server CPU per message",
		"client CPU per message", "backends running", "backends waiting on WAL", "backends waiting on other", "backends waiting for the client"}, costRows))
	fmt.Fprintf(&b, "\nA lone message (one worker: nothing ever joins its group), the modes interleaved call by call, %d rounds of %s; "+
		"time per message (median over rounds), its excess over single mode, and the ratio of times. A group that nobody joins runs after "+
		"MaxWait/5 unless it already holds its share of the messages in flight, which a lone message always does, so it runs at once "+
		"(without that rule it waited the gap, at least about 1 ms: Go's Linux netpoller sleeps in whole milliseconds):\n\n", loneRounds, loneDur)
	b.WriteString(Table([]string{"mode", "time per message", "added", "time / single's"}, loneRows))
	return b.String()
}
