package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("lease", leaseMode) }

// The lease section's workload: the parallel subscriber's rig with more
// keys (a key has one event in flight at a time, so a 500 ms call needs
// thousands of keys to keep thousands of calls going), and lease mode on a
// pool of leasePoolConns.
const (
	leaseKeys        = 20000
	leasePoolConns   = 16
	leaseMaxInFlight = 8192
	// leaseLongInFlight is the 500 ms call's MaxInFlight: by Little's law
	// a rate needs rate × (call + the phases' latency) messages in flight,
	// so a call ten times longer needs more of them for the same rate
	// (at 8,192 the 500 ms row is capped below 16,384 msg/s minus the
	// phases' share, measured 0.43–0.61× the 50 ms row). In lease mode a
	// message in flight holds no connection: the recipe is to size
	// MaxInFlight for the call.
	leaseLongInFlight = 16384
	leaseLongCall     = 500 * time.Millisecond
	// leaseFastInFlight: lease mode's messages in flight cost no
	// connection, so its recipe for the fast handler is a larger
	// MaxInFlight on the small pool (each message waits for two batches,
	// not one).
	leaseFastInFlight = 512
)

// leaseCall waits d, the provider call, honouring the message's context.
func leaseCall(msg *message.Message, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-msg.Context().Done():
		return msg.Context().Err()
	}
}

// leaseSlow is the lease-mode payment handler: the call with no
// transaction, then the business row registered with CompleteExec (the
// completion sends a batch's rows with its claims in one round trip).
func leaseSlow(d time.Duration) func(*message.Message) error {
	return func(msg *message.Message) error {
		if err := leaseCall(msg, d); err != nil {
			return err
		}
		return idem.CompleteExec(msg.Context(), businessSQL, msg.UUID, int64(len(msg.Payload)))
	}
}

// txSlow is the same handler in transaction mode: the business row, then
// the call inside the transaction.
func txSlow(d time.Duration) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return err
		}
		return leaseCall(msg, d)
	}
}

// txSampler samples pg_stat_activity for the lease pool's sessions: the longest
// "idle in transaction" and the oldest transaction holding back the xmin
// horizon (backend_xmin set), while it runs.
type txSampler struct {
	mu             sync.Mutex
	idleInTx, xmin time.Duration
	samples        int
	// idleQuery is the last statement of the session seen longest idle
	// in transaction: what it was doing when it stopped talking.
	idleQuery string
	// stall is the longest a 1 ms timer of this process fired late: how
	// long a goroutine that had its answer from the server could wait to
	// run (the machine's other load, this process's GC). An idle in
	// transaction of about this length is the client not scheduled, not a
	// transaction held by design.
	stall time.Duration
	stop  chan struct{}
	done  chan struct{}
}

// leaseAppName is the application_name of the lease pool's sessions: the
// sampler watches them alone, not the rig's transaction-mode pool, whose
// transactions (a call of 500 ms inside each) may still be ending when a
// lease variant starts right after a transaction-mode one.
func leaseAppName(schema string) string { return schema + "_lease" }

func (r *parRig) sample(ctx context.Context, o Options) (*txSampler, error) {
	conn, err := pgx.Connect(ctx, o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	s := &txSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go s.watchStalls()
	go func() {
		defer close(s.done)
		defer conn.Close(context.Background())
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
			var idle, xmin float64
			var query string
			err := conn.QueryRow(ctx, `SELECT
				coalesce(max(extract(epoch FROM clock_timestamp() - state_change)) FILTER (WHERE state = 'idle in transaction'), 0),
				coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)) FILTER (WHERE backend_xmin IS NOT NULL), 0),
				coalesce((array_agg(left(query, 120) ORDER BY state_change) FILTER (WHERE state = 'idle in transaction'))[1], '')
				FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()`, leaseAppName(r.db.Schema)).Scan(&idle, &xmin, &query)
			if err != nil {
				continue
			}
			s.mu.Lock()
			if d := time.Duration(idle * float64(time.Second)); d > s.idleInTx {
				s.idleInTx, s.idleQuery = d, query
			}
			s.xmin = max(s.xmin, time.Duration(xmin*float64(time.Second)))
			s.samples++
			s.mu.Unlock()
		}
	}()
	return s, nil
}

// watchStalls records in s.stall how late a 1 ms sleep wakes, until stop.
func (s *txSampler) watchStalls() {
	for {
		select {
		case <-s.stop:
			return
		default:
		}
		t0 := time.Now()
		time.Sleep(time.Millisecond)
		late := time.Since(t0) - time.Millisecond
		s.mu.Lock()
		s.stall = max(s.stall, late)
		s.mu.Unlock()
	}
}

func (s *txSampler) end() (idleInTx, xmin time.Duration, samples int) {
	close(s.stop)
	<-s.done
	return s.idleInTx, s.xmin, s.samples
}

// leaseVariant is one consumer of a lease workload: the events it counts,
// and whether pg_stat_activity is sampled while it runs.
type leaseVariant struct {
	c      parConsumer
	count  int
	sample bool
}

// leaseWorkload is one row pair of the lease section: transaction mode (the
// baseline) and lease mode on the same backlog.
type leaseWorkload struct {
	name     string
	backlog  int
	variants []leaseVariant
}

// leaseSizes are the events each workload counts.
type leaseSizes struct{ rounds, slowN, txN, longN, txLongN, fastN int }

func leaseSizesFor(o Options) leaseSizes {
	if o.Short {
		return leaseSizes{2, 3000, 600, 6000, 100, 800}
	}
	// The fast handler runs at over 10,000 msg/s: 16,000 events make a
	// run of more than a second (4,000 ran 0.3 s, and one scheduling
	// hiccup swung a round to 0.66–1.18 of its transaction-mode pair).
	return leaseSizes{o.Rounds, 12000, 3000, 24000, 300, 16000}
}

// leaseWorkloads: the 50 ms and 500 ms calls, then the fast handler, each
// transaction mode against lease mode on the small pool.
func (r *parRig) leaseWorkloads(n leaseSizes, small *pgxpool.Pool) []leaseWorkload {
	txMode := func(d time.Duration) parConsumer {
		return parConsumer{name: fmt.Sprintf("transaction mode, parallel subscriber (MaxInFlight %d), pool of %d", parMaxInFlight, parPoolConns),
			parallel: true, handler: txSlow(d)}
	}
	leased := func(d time.Duration, inFlight int) parConsumer {
		return parConsumer{name: fmt.Sprintf("lease mode (defaults), parallel subscriber (MaxInFlight %d), pool of %d", inFlight, leasePoolConns),
			parallel: true, lease: &idem.LeaseConfig{}, maxInFlight: inFlight, pool: small, handler: leaseSlow(d)}
	}
	return []leaseWorkload{
		{fmt.Sprintf("handler waits %s", parSlowCall), n.slowN, []leaseVariant{{txMode(parSlowCall), n.txN, false}, {leased(parSlowCall, leaseMaxInFlight), n.slowN, true}}},
		{fmt.Sprintf("handler waits %s", leaseLongCall), n.longN, []leaseVariant{{txMode(leaseLongCall), n.txLongN, false}, {leased(leaseLongCall, leaseLongInFlight), n.longN, true}}},
		{"fast handler (business row + outbox row)", n.fastN, []leaseVariant{
			{parConsumer{name: fmt.Sprintf("transaction mode, group commit (defaults), parallel subscriber (MaxInFlight %d), pool of %d", parMaxInFlight, parPoolConns),
				parallel: true, groupCommit: &idem.GroupCommitConfig{}, handler: r.fastHandler}, n.fastN, false},
			{parConsumer{name: fmt.Sprintf("lease mode (defaults), parallel subscriber (MaxInFlight %d), pool of %d", leaseFastInFlight, leasePoolConns),
				parallel: true, lease: &idem.LeaseConfig{}, maxInFlight: leaseFastInFlight, pool: small, handler: r.fastHandler}, n.fastN, false}}},
	}
}

// leaseMeasured is the rates per workload, variant and round of workloads
// measured in one rotation, and the worst idle-in-transaction and snapshot
// ages of each workload's sampled runs.
type leaseMeasured struct {
	rates             [][][]float64 // [workload][variant][round]
	idle, xmin, stall [][]time.Duration
}

// measureLease produces each workload's backlog and runs all their
// variants in one rotation for rounds rounds: workloads whose figures are
// compared with each other (the 500 ms call's rate against the 50 ms
// one's) share every round, so a noisy moment weighs on both.
func (r *parRig) measureLease(ctx context.Context, o Options, ws []leaseWorkload, rounds int) (leaseMeasured, error) {
	m := leaseMeasured{rates: make([][][]float64, len(ws)), idle: make([][]time.Duration, len(ws)), xmin: make([][]time.Duration, len(ws)), stall: make([][]time.Duration, len(ws))}
	type slot struct{ w, v int }
	var fns []func() (float64, error)
	var slots []slot
	for wi, w := range ws {
		in, err := r.topic("bench-lease-in")
		if err != nil {
			return m, err
		}
		if err := r.produce(in, w.backlog, 0); err != nil {
			return m, err
		}
		for vi, v := range w.variants {
			slots = append(slots, slot{wi, vi})
			fns = append(fns, func() (float64, error) { return r.runLeaseVariant(ctx, o, w, v, in, &m, wi) })
		}
	}
	rates, err := Rotate(rounds, fns...)
	if err != nil {
		return m, err
	}
	for wi, w := range ws {
		m.rates[wi] = make([][]float64, len(w.variants))
	}
	for i, sl := range slots {
		m.rates[sl.w][sl.v] = rates[i]
	}
	return m, nil
}

// runLeaseVariant runs v over topic in and returns its steady rate; a
// sampled variant adds its worst transaction ages to m's workload wi.
func (r *parRig) runLeaseVariant(ctx context.Context, o Options, w leaseWorkload, v leaseVariant, in string, m *leaseMeasured, wi int) (float64, error) {
	var s *txSampler
	var err error
	if v.sample {
		if s, err = r.sample(ctx, o); err != nil {
			return 0, err
		}
	}
	res, err := r.run(ctx, v.c, parRun{topic: in, count: v.count, steady: true})
	if s != nil {
		i, x, _ := s.end()
		m.idle[wi], m.xmin[wi] = append(m.idle[wi], i), append(m.xmin[wi], x)
		s.mu.Lock()
		stall := s.stall
		s.mu.Unlock()
		m.stall[wi] = append(m.stall[wi], stall)
		o.Logf("  lease, %s, %s: longest idle in transaction %s after %q; oldest snapshot %s; longest client stall (1 ms timer late) %s", w.name, v.c.name, fmtDur(i), s.idleQuery, fmtDur(x), fmtDur(stall))
	}
	if err != nil {
		return 0, fmt.Errorf("%s, %s: %w", w.name, v.c.name, err)
	}
	return res.rate, nil
}

func leaseMode(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	r.keys = leaseKeys
	if err := r.warm(ctx); err != nil {
		return Section{}, err
	}
	small, err := r.pool(ctx, o, leasePoolConns)
	if err != nil {
		return Section{}, err
	}
	defer small.Close()

	n := leaseSizesFor(o)
	workloads := r.leaseWorkloads(n, small)
	// The two waiting workloads in one rotation (the 500 ms row is judged
	// by its ratio to the 50 ms one, round by round), the fast one alone.
	slow, err := r.measureLease(ctx, o, workloads[:2], n.rounds)
	if err != nil {
		return Section{}, err
	}
	fast, err := r.measureLease(ctx, o, workloads[2:], n.rounds)
	if err != nil {
		return Section{}, err
	}
	all := leaseMeasured{rates: append(slow.rates, fast.rates...), idle: append(slow.idle, fast.idle...), xmin: append(slow.xmin, fast.xmin...), stall: append(slow.stall, fast.stall...)}
	rows, actRows := leaseRows(o, workloads, all)
	return Section{Title: "Lease mode: a slow call holds no transaction", Markdown: leaseMarkdown(o, n, rows, actRows)}, nil
}

// leaseRows are the section's two tables: rates with their targets, and
// the sampled transaction ages.
func leaseRows(o Options, workloads []leaseWorkload, m leaseMeasured) (rows, actRows [][]string) {
	for wi, w := range workloads {
		rates := m.rates[wi]
		st := Summarise(Ratios(rates[0], rates[1]))
		med := Summarise(rates[1]).Median
		var target string
		switch wi {
		case 0:
			target = fmt.Sprintf("≥ 3,000 msg/s and ≥ 2.5×: %s", pass(med >= 3000 && st.Median >= 2.5))
		case 1:
			// Same-round ratios of the lease rows: 500 ms / 50 ms.
			own := Summarise(Ratios(m.rates[0][1], rates[1]))
			target = fmt.Sprintf("≥ 0.8× its %s figure (%.2f×, rounds %.2f–%.2f): %s", parSlowCall, own.Median, own.Min, own.Max, pass(own.Median >= 0.8))
		case 2:
			target = fmt.Sprintf("≥ 0.8×: %s", pass(st.Median >= 0.8))
		}
		o.Logf("  lease, %s: %s %s msg/s; %s %s msg/s; ratio %s", w.name, w.variants[0].c.name, fmtRate(rates[0]), w.variants[1].c.name, fmtRate(rates[1]), st)
		rows = append(rows, []string{w.name, w.variants[0].c.name, fmt.Sprint(w.variants[0].count), fmtRate(rates[0]), "1", "–"})
		rows = append(rows, []string{w.name, w.variants[1].c.name, fmt.Sprint(w.variants[1].count), fmtRate(rates[1]), st.String(), target})
		if len(m.idle[wi]) > 0 {
			maxIdle, maxXmin := slicesMax(m.idle[wi]), slicesMax(m.xmin[wi])
			actRows = append(actRows, []string{w.name, w.variants[1].c.name, fmtDur(maxIdle), fmtDur(maxXmin),
				fmt.Sprintf("≤ 100 ms and ≤ 1 s: %s", pass(maxIdle <= 100*time.Millisecond && maxXmin <= time.Second)), fmtDur(slicesMax(m.stall[wi]))})
		}
	}
	return rows, actRows
}

// pool opens a pool of conns connections on the rig's schema, named after
// it in pg_stat_activity (the sampler finds its sessions by that name).
func (r *parRig) pool(ctx context.Context, o Options, conns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = r.db.Schema
	cfg.ConnConfig.RuntimeParams["application_name"] = leaseAppName(r.db.Schema)
	cfg.MaxConns = conns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// leaseMarkdown is the lease section: the rates, the workload, then the
// sampled transaction ages.
func leaseMarkdown(o Options, n leaseSizes, rows, actRows [][]string) string {
	var b strings.Builder
	b.WriteString(Table([]string{"workload", "consumer", "events counted", "msg/s (median)", "ratio to transaction mode", "target"}, rows))
	fmt.Fprintf(&b, "\nKafka (%s, %d partitions, %d keys) → watermill Router → dedup middleware → handler. The waiting handlers "+
		"model a payment handler: a provider call (a wait) and a business row. In transaction mode the row is written "+
		"and the wait runs inside the message's transaction; in lease mode the wait runs with no transaction and the row is "+
		"registered with `middleware.CompleteExec`, sent with the completion's claims in one pipelined transaction. Transaction mode runs on the parallel "+
		"subscriber's recipe (MaxInFlight %d, a pool of %d: a connection per message in flight); lease mode on a pool of %d "+
		"(its phases hold 2 × LeaseConfig.Concurrency + 1 = 9 at most) with MaxInFlight %d, and %d with the %s call (a rate needs rate × call time messages in flight, and lease mode's cost no connection). Transaction mode counts fewer events "+
		"(%d with the %s wait, %d with the %s one): its rate is flat, connections ÷ call time. The fast handler's lease "+
		"handler registers both writes with `idem.Complete` (at once in transaction mode); the lease variant runs MaxInFlight %d (each message waits for two phase batches, a group-commit message for one; in flight it holds no connection). Every rate here is the steady rate, over the commits between the 10th and the 90th percentile of the run: a run starts with one call's wait before the first commit (500 ms with the long call) and ends with a tail, and neither is throughput lost to the mode. %d rounds, the variants' order rotated each round; ratios are of the same round.\n\n",
		kafkaDesc(o.Brokers), parPartitions, leaseKeys, parMaxInFlight, parPoolConns, leasePoolConns, leaseMaxInFlight, leaseLongInFlight, leaseLongCall,
		n.txN, parSlowCall, n.txLongN, leaseLongCall, leaseFastInFlight, n.rounds)
	b.WriteString("The two waiting workloads share one rotation (four variants, their order rotated each round), so the 500 ms row's " +
		"target is the median of its same-round ratios to the 50 ms lease row (the rounds' range beside it), not two medians of different moments.\n\n")
	b.WriteString("While the lease-mode rows with a call ran, `pg_stat_activity` was sampled every 10 ms for the lease pool's sessions (their own application_name: the transaction-mode pool's calls may still be ending when a lease run starts): " +
		"the longest a session sat \"idle in transaction\", and the oldest transaction holding a snapshot (backend_xmin set: " +
		"what holds back vacuum's horizon). Worst of every round:\n\n")
	b.WriteString("The last column is the longest a 1 ms timer of the bench process fired late meanwhile: how long a goroutine holding a " +
		"transaction's answer could wait to run. An idle in transaction of about that length is the client not scheduled (a loaded " +
		"machine, this process's garbage collection), not a transaction held across a call; on a shared machine read the two together.\n\n")
	b.WriteString(Table([]string{"workload", "consumer", "longest idle in transaction", "oldest snapshot held", "target", "longest client stall"}, actRows))
	return b.String()
}

func slicesMax(xs []time.Duration) time.Duration {
	var m time.Duration
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}
