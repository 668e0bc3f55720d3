package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() {
	Register("dedup-overhead", dedupOverhead)
	Register("dedup-tracing", dedupTracing)
	Register("duplicate-path", duplicatePath)
	Register("round-trips", roundTrips)
	Register("contract-decode", contractDecode) // contract.go
}

// businessSQL is the one business write of the benchmark handler.
const businessSQL = "INSERT INTO bench_order (ref, amount) VALUES ($1, $2)"

// dedupRig is a schema with the processed_event and business tables, the
// handler, the plain-transaction baseline and the dedup middleware around it.
type dedupRig struct {
	db      *DB
	table   deduplicator.TableConfig
	dedup   *idem.Dedup
	handler message.HandlerFunc
	plain   message.HandlerFunc // BEGIN; handler; COMMIT
	deduped message.HandlerFunc
}

func newDedupRig(ctx context.Context, o Options, prefix string, maxConns int32, configure func(*pgxpool.Config)) (*dedupRig, error) {
	db, err := NewDB(ctx, o, prefix, maxConns, func(c *pgxpool.Config) {
		c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		if configure != nil {
			configure(c)
		}
	})
	if err != nil {
		return nil, err
	}
	table := deduplicator.TableConfig{Schema: db.Schema}
	if err := migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)); err != nil {
		db.Close()
		return nil, err
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE bench_order (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref text NOT NULL, amount bigint NOT NULL)"); err != nil {
		db.Close()
		return nil, err
	}
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "bench", Table: table}, nil)
	if err != nil {
		db.Close()
		return nil, err
	}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload)))
		return nil, err
	}
	table.Table = "processed_event" // TableConfig.Table's default
	return &dedupRig{db: db, table: table, dedup: d, handler: handler, plain: plainTx(db.Pool)(handler), deduped: d.Middleware(handler)}, nil
}

// plainTx is the baseline: the same handler in its own transaction, with the
// transaction in the context where the handler looks for it, and no claim.
func plainTx(pool *pgxpool.Pool) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			defer func() {
				msg.SetContext(ctx)
				if err := tx.Rollback(context.WithoutCancel(ctx)); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
					panic(err)
				}
			}()
			msg.SetContext(idemctx.With(ctx, &idemctx.Value{Tx: tx}))
			out, err := h(msg)
			if err != nil {
				return nil, err
			}
			return out, tx.Commit(ctx)
		}
	}
}

// newEventMessage returns a message stamped with a fresh UUIDv7 event id.
func newEventMessage(ctx context.Context) (*message.Message, uuid.UUID) {
	id := uuid.Must(uuid.NewV7())
	return eventMessage(ctx, id), id
}

func eventMessage(ctx context.Context, id uuid.UUID) *message.Message {
	msg := message.NewMessage(id.String(), []byte(`{"amount":42}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	msg.SetContext(ctx)
	return msg
}

func (r *dedupRig) close() { r.db.Close() }

// run processes fresh events through h on workers goroutines for d.
func runFresh(ctx context.Context, workers int, d time.Duration, h message.HandlerFunc, seen *idList) (float64, error) {
	return Drive(ctx, workers, d, func(ctx context.Context, _ int) error {
		msg, id := newEventMessage(ctx)
		if _, err := h(msg); err != nil {
			return err
		}
		seen.add(id)
		return nil
	})
}

// idList collects processed ids, for replaying them as duplicates.
type idList struct {
	mu  sync.Mutex
	ids []uuid.UUID
	i   atomic.Int64
}

func (l *idList) add(id uuid.UUID) {
	if l == nil {
		return
	}
	l.mu.Lock()
	l.ids = append(l.ids, id)
	l.mu.Unlock()
}

func (l *idList) next() uuid.UUID {
	i := l.i.Add(1)
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ids[int(i)%len(l.ids)]
}

// durations returns the length of one measurement.
func measureFor(o Options, full, short time.Duration) time.Duration {
	if o.Short {
		return short
	}
	return full
}

func synchronousCommit(ctx context.Context, pool *pgxpool.Pool) string {
	var v string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&v); err != nil {
		return "unknown"
	}
	return v
}

func fmtRate(xs []float64) string {
	return fmt.Sprintf("%.0f", Summarise(xs).Median)
}

// poolOnly hides the pool's concrete type: the middleware then takes its
// generic path (BEGIN, then the claim: two round trips), which is also what
// any Beginner other than *pgxpool.Pool and *pgx.Conn gets.
type poolOnly struct{ *pgxpool.Pool }

func freshOp(h message.HandlerFunc, seen *idList) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		msg, id := newEventMessage(ctx)
		if _, err := h(msg); err != nil {
			return err
		}
		seen.add(id)
		return nil
	}
}

func dedupOverhead(ctx context.Context, o Options) (Section, error) {
	workersList := []int{1, 4, 16}
	rig, err := newDedupRig(ctx, o, "overhead", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	twoRT, err := idem.NewDedup(idem.Config{DB: poolOnly{rig.db.Pool}, ConsumerGroup: "bench-2rt", Table: rig.table}, nil)
	if err != nil {
		return Section{}, err
	}
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	ops := []func(context.Context) error{freshOp(rig.plain, nil), freshOp(rig.deduped, nil), freshOp(twoRT.Middleware(rig.handler), nil),
		claimFloor(rig.db.Pool, claimsql.Claim(ident.Quote(rig.table.Schema, rig.table.Table)))}

	// Warm every connection: dial and prepare all statements.
	if _, err := Interleave(ctx, 1, 16, 300*time.Millisecond, ops...); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for _, w := range workersList {
		rates, err := Interleave(ctx, rounds, w, d, ops...)
		if err != nil {
			return Section{}, err
		}
		now, before := Summarise(Ratios(rates[0], rates[1])), Summarise(Ratios(rates[0], rates[2]))
		floor, overFloor := Summarise(Ratios(rates[0], rates[3])), Summarise(Ratios(rates[3], rates[1]))
		o.Logf("  dedup-overhead workers=%d: plain %s msg/s, dedup %s msg/s, ratio %s (two-round-trip claim: %s; the claim's SQL by hand: %s; dedup/by hand: %s)",
			w, fmtRate(rates[0]), fmtRate(rates[1]), now, before, floor, overFloor)
		rows = append(rows, []string{fmt.Sprint(w), fmtRate(rates[0]), fmtRate(rates[1]), now.String(), pass(now.Median >= 0.90), before.String(), floor.String(), overFloor.String()})
	}

	// How much of the plain transaction is the COMMIT's WAL flush: the same
	// plain handler with synchronous_commit off, at one worker.
	async, err := newDedupRig(ctx, o, "overhead_async", 1, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	})
	if err != nil {
		return Section{}, err
	}
	defer async.close()
	flushRates, err := Interleave(ctx, rounds, 1, d, freshOp(async.plain, nil), freshOp(rig.plain, nil))
	if err != nil {
		return Section{}, err
	}
	flush := Summarise(Ratios(flushRates[0], flushRates[1]))
	o.Logf("  dedup-overhead plain tx, synchronous_commit on/off at 1 worker: %s", flush)

	var b strings.Builder
	b.WriteString(Table([]string{"workers", "plain tx (msg/s, median)", "dedup (msg/s, median)", "ratio dedup/plain", "median ≥ 0.90", "ratio with BEGIN and claim as 2 round trips (before)",
		"the claim's SQL by hand / plain", "dedup / the claim's SQL by hand"}, rows))
	fmt.Fprintf(&b, "\nBaseline: the handler writes one business row in its own transaction (BEGIN; INSERT; COMMIT on the same pool). "+
		"Subject: the same handler behind the dedup middleware, writing through `idem.MustTxFromContext`. "+
		"Last column: the middleware's generic path, BEGIN then the claim (what it did before BEGIN and the claim were pipelined, "+
		"and what a Beginner other than `*pgxpool.Pool` or `*pgx.Conn` still gets). Fresh UUIDv7 events; `synchronous_commit = %s` (the server's setting, left as is).\n\n"+
		"Method: each worker goroutine runs the variants call by call in turn (plain, dedup, two-round-trip dedup, plain, …), timing every call, "+
		"so all variants share the same moments of a shared, noisy machine; a variant's rate is workers / its mean call time. "+
		"%d rounds of %s per concurrency; cells show the median and (min–max) over rounds.\n\n"+
		"Both the plain and the dedup path make 3 round trips per message, but the dedup path runs 4 statements instead of 3: "+
		"the claim is a second INSERT (heap tuple, primary-key and processed_at index entries, speculative-insertion bookkeeping). "+
		"Weight of the COMMIT's WAL flush on this server: the plain transaction with synchronous_commit on runs at %s of its speed with it off (1 worker). "+
		"Where the flush or the network round trip dominates (remote database, slower disk), the claim's extra statement weighs less and the ratio moves toward 1; "+
		"on a CPU-bound server it weighs up to a statement's share. "+
		"The last two columns split the ratio: \"the claim's SQL by hand\" issues the dedup path's statements without the library "+
		"(BEGIN and the same claim INSERT in one pipelined batch, the business INSERT, COMMIT), so its ratio to the plain transaction is what the claim statement itself costs, "+
		"and dedup / by hand is what the library adds around it.\n",
		synchronousCommit(ctx, rig.db.Pool), rounds, d, flush)
	return Section{Title: "Dedup overhead: plain transaction vs dedup middleware", Markdown: b.String()}, nil
}

// claimFloor is the dedup path's SQL written by hand, with no middleware:
// BEGIN and the claim (claimSQL) in one pipelined batch, the benchmark
// handler's business INSERT, COMMIT. Against the plain transaction it
// prices the claim statement alone; the middleware against it prices the
// library around the statement.
func claimFloor(pool *pgxpool.Pool, claimSQL string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		msg, id := newEventMessage(ctx)
		b := &pgx.Batch{}
		b.BeginTx(pgx.TxOptions{})
		b.Queue(claimSQL, dbx.UUID(id), "bench-floor")
		br := pool.SendBatch(ctx, b)
		tx := br.Tx()
		_, err := br.Exec()
		if err == nil {
			var tag pgconn.CommandTag
			if tag, err = br.Exec(); err == nil && tag.RowsAffected() != 1 {
				err = fmt.Errorf("bench: claim by hand of %s found a duplicate", id)
			}
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			_, err = tx.Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload)))
		}
		if err == nil {
			return tx.Commit(ctx)
		}
		if tx != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
		return err
	}
}

// tracedOp is [freshOp] for messages that carry a producer's trace context,
// as a record of a traced chain does: a W3C traceparent (a fresh sampled
// trace per message) in the metadata. The untraced middleware ignores it.
func tracedOp(h message.HandlerFunc) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		msg, _ := newEventMessage(ctx)
		tid, sid := trace.TraceID(uuid.New()), trace.SpanID{}
		copy(sid[:], tid[8:])
		sid[0] |= 1 // never all zero
		msg.Metadata.Set("traceparent", "00-"+tid.String()+"-"+sid.String()+"-01")
		_, err := h(msg)
		return err
	}
}

// dedupTracing measures what OpenTelemetry tracing adds to the dedup
// middleware: the same rig and handler behind three middlewares, one with no
// TracerProvider (none installed globally either: no span at all) and two
// with an SDK TracerProvider whose exporter drops the spans, one through the
// batch span processor (what production uses) and one through the simple,
// synchronous one (the span's own cost), interleaved call by call.
func dedupTracing(ctx context.Context, o Options) (Section, error) {
	workersList := []int{1, 4, 16}
	if o.Short {
		workersList = []int{4}
	}
	rig, err := newDedupRig(ctx, o, "tracing", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	processors := []struct {
		name string
		tp   *sdktrace.TracerProvider
	}{
		{"batch (`sdktrace.WithBatcher`)", sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()))},
		{"simple (`sdktrace.NewSimpleSpanProcessor`)", sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewSimpleSpanProcessor(tracetest.NewNoopExporter())))},
	}
	ops := []func(context.Context) error{tracedOp(rig.deduped)}
	for _, p := range processors {
		defer func() { _ = p.tp.Shutdown(context.WithoutCancel(ctx)) }()
		traced, err := idem.NewDedup(idem.Config{DB: rig.db.Pool, ConsumerGroup: "bench", Table: rig.table, TracerProvider: p.tp}, nil)
		if err != nil {
			return Section{}, err
		}
		ops = append(ops, tracedOp(traced.Middleware(rig.handler)))
	}
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)

	// Warm every connection: dial and prepare all statements.
	if _, err := Interleave(ctx, 1, 16, measureFor(o, 300*time.Millisecond, 100*time.Millisecond), ops...); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for _, w := range workersList {
		rates, err := Interleave(ctx, rounds, w, d, ops...)
		if err != nil {
			return Section{}, err
		}
		for i, p := range processors {
			on := rates[i+1]
			st := Summarise(Ratios(rates[0], on))
			// What tracing adds to one call: workers / rate is a variant's
			// mean call time in that round.
			added := make([]float64, len(on))
			for r := range added {
				added[r] = (float64(w)/on[r] - float64(w)/rates[0][r]) * 1e6
			}
			ad := Summarise(added)
			o.Logf("  dedup-tracing workers=%d %s: off %s msg/s, on %s msg/s, ratio %s, added to the mean call %.0fµs (%.0f–%.0f)",
				w, p.name, fmtRate(rates[0]), fmtRate(on), st, ad.Median, ad.Min, ad.Max)
			rows = append(rows, []string{p.name, fmt.Sprint(w), fmtRate(rates[0]), fmtRate(on), st.String(), pass(st.Median >= 0.95),
				fmt.Sprintf("%.0f (%.0f–%.0f)", ad.Median, ad.Min, ad.Max)})
		}
	}
	var b strings.Builder
	b.WriteString(Table([]string{"span processor", "workers", "tracing off (msg/s, median)", "tracing on (msg/s, median)", "ratio on/off", "median ≥ 0.95", "added to the mean call time (µs)"}, rows))
	fmt.Fprintf(&b, "\nBaseline: the dedup middleware of the overhead section above with no `TracerProvider` (and none installed globally: "+
		"it makes no span and allocates nothing for tracing). Subject: the same handler, rig and pool behind a middleware with "+
		"`idem.Config.TracerProvider` set to an SDK TracerProvider whose exporter drops every span (`tracetest.NewNoopExporter()`): "+
		"per message, the trace context extracted from the metadata, a consumer span with its attributes and its `claim` and `commit` events, "+
		"handed to the span processor. Every message carries a `traceparent` (a fresh sampled trace each), as the records of a traced chain do, "+
		"so the span is a recorded child. Two providers: the batch span processor, which production uses (`sdktrace.WithBatcher`: "+
		"the ended span is queued, a goroutine of the SDK exports batches), and the simple one (the span exported synchronously at its end: "+
		"the cost of the span itself). Not included: a real exporter's work (encoding and sending; with the batch processor, "+
		"in its goroutine, off the message path).\n\n"+
		"Interleaved call by call as above (off, batch, simple, off, …); %d rounds of %s. Last column: the difference of the mean call times, "+
		"on minus off (with several workers it includes their wait for the CPU), median and (min–max) over rounds.\n\n"+
		"Where the batch row is below the simple one at 1 worker, that is the hand-off, not the span: each ended span wakes the "+
		"processor's goroutine, and on a 2-core machine the thread that wakes for it competes with the PostgreSQL backend the worker waits for "+
		"(with `GOMAXPROCS=1` the two cost the same); with several workers in flight the goroutine stays busy.\n",
		rounds, d)
	return Section{Title: "Tracing overhead: dedup middleware with an SDK TracerProvider vs without", Markdown: b.String()}, nil
}

func pass(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}

func duplicatePath(ctx context.Context, o Options) (Section, error) {
	rig, err := newDedupRig(ctx, o, "duplicate", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	seen := &idList{}
	if _, err := runFresh(ctx, 4, 300*time.Millisecond, rig.deduped, seen); err != nil {
		return Section{}, err
	}
	var handlerRuns atomic.Int64
	dupH := rig.dedup.Middleware(func(*message.Message) ([]*message.Message, error) {
		handlerRuns.Add(1)
		return nil, nil
	})
	dupOp := func(ctx context.Context) error {
		_, err := dupH(eventMessage(ctx, seen.next()))
		return err
	}
	var rows [][]string
	for _, w := range []int{1, 4, 16} {
		rates, err := Interleave(ctx, rounds, w, d, freshOp(rig.deduped, seen), dupOp)
		if err != nil {
			return Section{}, err
		}
		st := Summarise(Ratios(rates[0], rates[1]))
		o.Logf("  duplicate-path workers=%d: new %s msg/s, duplicate %s msg/s, ratio %s", w, fmtRate(rates[0]), fmtRate(rates[1]), st)
		rows = append(rows, []string{fmt.Sprint(w), fmtRate(rates[0]), fmtRate(rates[1]), st.String(), pass(st.Median >= 2)})
	}
	if n := handlerRuns.Load(); n != 0 {
		return Section{}, fmt.Errorf("duplicate path ran the handler %d times", n)
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workers", "new events (msg/s, median)", "duplicates (msg/s, median)", "ratio duplicate/new", "median ≥ 2"}, rows))
	fmt.Fprintf(&b, "\nBaseline: first-time events through the dedup middleware ({BEGIN + claim}, one business row, COMMIT). "+
		"Subject: redeliveries of events already processed: {BEGIN + claim} finds the row, ROLLBACK; the handler never runs, "+
		"and the transaction never got a transaction id, so it writes no WAL and waits for no flush. "+
		"Interleaved call by call as above; %d rounds of %s.\n", rounds, d)
	return Section{Title: "Duplicate path: skipping a processed event vs processing a new one", Markdown: b.String()}, nil
}

func roundTrips(ctx context.Context, o Options) (Section, error) {
	var rows [][]string
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		rt := &rtcount.Counter{}
		rig, err := newDedupRig(ctx, o, "roundtrips", 1, func(c *pgxpool.Config) {
			c.ConnConfig.DialFunc = rt.DialFunc()
			c.ConnConfig.DefaultQueryExecMode = mode
		})
		if err != nil {
			return Section{}, err
		}
		// Warm up (dial, prepare), then count.
		warm := uuid.Must(uuid.NewV7())
		for _, h := range []message.HandlerFunc{rig.plain, rig.deduped, rig.deduped} {
			if _, err := h(eventMessage(ctx, warm)); err != nil {
				rig.close()
				return Section{}, err
			}
		}
		rt.Reset()
		const n = 20
		var plain, first, dup float64
		for range n {
			if _, err := rig.plain(eventMessage(ctx, uuid.Must(uuid.NewV7()))); err != nil {
				rig.close()
				return Section{}, err
			}
		}
		plain = float64(rt.Load()) / n
		rt.Reset()
		ids := make([]uuid.UUID, n)
		for i := range ids {
			ids[i] = uuid.Must(uuid.NewV7())
			if _, err := rig.deduped(eventMessage(ctx, ids[i])); err != nil {
				rig.close()
				return Section{}, err
			}
		}
		first = float64(rt.Load()) / n
		rt.Reset()
		for _, id := range ids {
			if _, err := rig.deduped(eventMessage(ctx, id)); err != nil {
				rig.close()
				return Section{}, err
			}
		}
		dup = float64(rt.Load()) / n
		rig.close()
		o.Logf("  round-trips %s: plain %.1f, first-time %.1f, duplicate %.1f", mode, plain, first, dup)
		rows = append(rows, []string{mode.String(), fmt.Sprintf("%g", plain), fmt.Sprintf("%g", first), fmt.Sprintf("%g", dup)})
	}
	wal, err := walPerStatement(ctx, o)
	if err != nil {
		return Section{}, err
	}
	var b strings.Builder
	b.WriteString(Table([]string{"pgx exec mode", "plain tx (BEGIN; INSERT; COMMIT)", "dedup, first-time", "dedup, duplicate"}, rows))
	b.WriteString("\nPostgreSQL round trips per message, counted at the net.Conn level (a burst of writes followed by the server's answer), " +
		"averaged over 20 messages on a warm connection; the handler makes one INSERT. Asserted exactly in `middleware/roundtrip_test.go`.\n\n")
	b.WriteString("WAL written by each statement (EXPLAIN (ANALYZE, WAL), so only that statement is counted, second run, no full-page images); " +
		"the COMMIT record of a transaction that wrote comes on top:\n\n")
	b.WriteString(Table([]string{"statement", "WAL records", "WAL bytes", "transaction id assigned"}, wal))
	return Section{Title: "Round trips per message", Markdown: b.String()}, nil
}

// walPerStatement measures with EXPLAIN (ANALYZE, WAL) the WAL of the claim
// of a new event, of a duplicate's claim, and of the business INSERT, each
// run twice (the first may write full-page images) and reported for the
// second, inside transactions that are rolled back.
func walPerStatement(ctx context.Context, o Options) ([][]string, error) {
	rig, err := newDedupRig(ctx, o, "wal", 1, nil)
	if err != nil {
		return nil, err
	}
	defer rig.close()
	claimSQL := claimsql.Claim(ident.Quote(rig.table.Schema, rig.table.Table))
	dupID := uuid.Must(uuid.NewV7())
	if _, err := rig.deduped(eventMessage(ctx, dupID)); err != nil {
		return nil, err
	}
	type walUse struct {
		Plan struct {
			Records int64 `json:"WAL Records"`
			FPI     int64 `json:"WAL FPI"`
			Bytes   int64 `json:"WAL Bytes"`
		}
	}
	measure := func(sql string, args func() []any) (walUse, bool, error) {
		var w walUse
		var xid *int64
		for range 2 {
			tx, err := rig.db.Pool.Begin(ctx)
			if err != nil {
				return w, false, err
			}
			var out []walUse
			err = tx.QueryRow(ctx, "EXPLAIN (ANALYZE, WAL, FORMAT JSON) "+sql, args()...).Scan(&out)
			if err == nil {
				err = tx.QueryRow(ctx, "SELECT txid_current_if_assigned()").Scan(&xid)
			}
			_ = tx.Rollback(ctx)
			if err != nil {
				return w, false, err
			}
			if len(out) == 1 {
				w = out[0]
			}
		}
		return w, xid != nil, nil
	}
	var rows [][]string
	for _, c := range []struct {
		name string
		sql  string
		args func() []any
	}{
		{"claim, first-time", claimSQL, func() []any { return []any{uuid.Must(uuid.NewV7()), "bench"} }},
		{"claim, duplicate", claimSQL, func() []any { return []any{dupID, "bench"} }},
		{"business INSERT (the handler's row)", businessSQL, func() []any { return []any{uuid.NewString(), int64(13)} }},
	} {
		w, xid, err := measure(c.sql, c.args)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", c.name, err)
		}
		o.Logf("  WAL %s: %d records, %d bytes (FPI %d), xid assigned %v", c.name, w.Plan.Records, w.Plan.Bytes, w.Plan.FPI, xid)
		rows = append(rows, []string{c.name, fmt.Sprint(w.Plan.Records), fmt.Sprint(w.Plan.Bytes), pass(xid)})
	}
	return rows, nil
}
