package bench

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("parallel", parallelSubscriber) }

// The workload of the parallel-subscriber section: 4 partitions,
// 1,000 keys, a pool of 64 connections, the parallel subscriber at
// MaxInFlight 64.
const (
	parPartitions  = 4
	parKeys        = 1000
	parPoolConns   = 64
	parMaxInFlight = 64
	parSlowCall    = 50 * time.Millisecond
)

// parRig is a broker, a schema (processed_event, a business table, an
// outbox) and a pool of parPoolConns connections.
type parRig struct {
	o       Options
	brokers []string
	db      *DB
	table   deduplicator.TableConfig
	ob      *outbox.Outbox
	outT    string
	seq     atomic.Int64
	close   func()
	// keys is how many keys produce spreads events over; 0 means parKeys.
	keys int
}

func newParRig(ctx context.Context, o Options) (*parRig, error) {
	r := &parRig{o: o, brokers: o.Brokers, close: func() {}}
	if len(r.brokers) == 0 {
		c, err := kafkatest.NewFake()
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		r.brokers = c.ListenAddrs()
		r.close = c.Close
	}
	db, err := NewDB(ctx, o, "par", parPoolConns, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["application_name"] = c.ConnConfig.RuntimeParams["search_path"]
	})
	if err != nil {
		r.close()
		return nil, err
	}
	r.db = db
	prev := r.close
	r.close = func() { db.Close(); prev() }
	fail := func(err error) (*parRig, error) { r.close(); return nil, err }
	r.table = deduplicator.TableConfig{Schema: db.Schema}
	if err := migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(r.table)); err != nil {
		return fail(err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE bench_order (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref text NOT NULL, amount bigint NOT NULL)"); err != nil {
		return fail(err)
	}
	r.outT = "bench-par-out"
	if r.ob, err = outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{r.outT}}, nil); err != nil {
		return fail(err)
	}
	if err := migrate.Up(ctx, db.Pool, outbox.MigrationLine(r.ob.Config(), r.outT)); err != nil {
		return fail(err)
	}
	return r, nil
}

// topic creates a unique topic of parPartitions partitions.
func (r *parRig) topic(prefix string) (string, error) {
	name := fmt.Sprintf("%s-%d-%s", prefix, r.seq.Add(1), uuid.NewString()[:8])
	return name, kafkatest.CreateTopic(r.brokers, name, parPartitions)
}

// produce publishes n events keyed key-(i mod parKeys), each with its send
// time in sentAtKey. With rate > 0 they are paced: every millisecond the
// events due by then are sent in one batch.
func (r *parRig) produce(topic string, n int, rate float64) error {
	return r.produceMarked(topic, n, rate, false)
}

// produceMarked is produce; warmup marks every event with warmupKey.
func (r *parRig) produceMarked(topic string, n int, rate float64, warmup bool) error {
	p, err := sarama.NewSyncProducer(r.brokers, idemkafka.SaramaProducerConfig(nil))
	if err != nil {
		return err
	}
	defer p.Close()
	m := idemkafka.Marshaler{}
	keys := parKeys
	if r.keys > 0 {
		keys = r.keys
	}
	start := time.Now()
	var batch []*sarama.ProducerMessage
	for i := 0; i < n; {
		due := n
		if rate > 0 {
			due = min(n, int(time.Since(start).Seconds()*rate)+1)
			if due <= i {
				time.Sleep(time.Millisecond)
				continue
			}
		}
		batch = batch[:0]
		now := strconv.FormatInt(time.Now().UnixNano(), 10)
		for ; i < due && len(batch) < 500; i++ {
			id := uuid.Must(uuid.NewV7())
			msg := message.NewMessage(id.String(), []byte(`{"amount":42}`))
			msg.Metadata.Set(publisher.MetadataEventID, id.String())
			msg.Metadata.Set(sentAtKey, now)
			if warmup {
				msg.Metadata.Set(warmupKey, "1")
			}
			publisher.WithPartitionKey(msg, "key-"+strconv.Itoa(i%keys))
			pm, err := m.Marshal(topic, msg)
			if err != nil {
				return err
			}
			batch = append(batch, pm)
		}
		if err := p.SendMessages(batch); err != nil {
			return err
		}
	}
	return nil
}

// parConsumer is one way of consuming: watermill-kafka's subscriber or
// the parallel one, the dedup middleware in one mode.
type parConsumer struct {
	name        string
	parallel    bool
	groupCommit *idem.GroupCommitConfig
	// Lease mode (the lease section): lease, maxInFlight (0: parMaxInFlight),
	// pool (nil: the rig's) and handler (nil: the run's).
	lease       *idem.LeaseConfig
	maxInFlight int
	pool        *pgxpool.Pool
	handler     func(msg *message.Message) error
	// share consumes with the franz-go subscriber in a share group (the
	// share-group section) instead.
	share bool
	// franz consumes with the franz-go engine's subscriber
	// (idemkafka/franz) instead of the parallel subscriber.
	franz bool
	// memory feeds the run's count of messages built in memory instead
	// (memSubscriber: no Kafka client, the engines' ceiling).
	memory bool
	// progress: the subscriber keeps the group's position in PostgreSQL
	// (idemkafka.ClientConfig.Progress, parallel.SubscriberConfig.Progress),
	// the configuration docs/guarantees.md recommends, so the middleware
	// writes no position per transaction.
	progress bool
}

// mode is the middleware's mode of c: lease mode, group commit, or nil
// (transaction mode).
func (c parConsumer) mode() idem.Mode {
	if c.lease != nil {
		return c.lease
	}
	if c.groupCommit != nil {
		return c.groupCommit
	}
	return nil
}

// parRun is one consumer over a topic, until count events committed.
type parRun struct {
	topic   string
	count   int
	handler func(msg *message.Message) error
	// lat, when set, gets each committed event's time from publish to
	// commit, and toHandler its time from publish to the router's handler
	// (the subscriber's share: fetch, dispatch), warm-up events left out.
	lat, toHandler *durations
	// warmup events (marked with warmupKey) come first; warmed is closed
	// once they are all committed. count includes them.
	warmup int
	warmed chan struct{}
	// raw runs handler without the dedup middleware (and without a
	// database).
	raw bool
	// steady measures the rate between the 10th and the 90th percentile of
	// the commits (span.steadyRate) instead of from the first event handled.
	steady bool
}

// parResult is one run.
type parResult struct {
	rate  float64 // events per second, first handled to the count-th committed
	stats idem.Stats
	// refetched is the parallel subscriber's Stats().Refetched: records it
	// spilled and read again from Kafka (0 for watermill-kafka's).
	refetched uint64
}

// run consumes run.topic with c in a new consumer group until run.count
// events are committed.
func (r *parRig) run(ctx context.Context, c parConsumer, run parRun) (parResult, error) {
	var res parResult
	group := fmt.Sprintf("bench-par-%d", r.seq.Add(1))
	inFlight, pool, handler := parMaxInFlight, r.db.Pool, run.handler
	if c.maxInFlight > 0 {
		inFlight = c.maxInFlight
	}
	if c.pool != nil {
		pool = c.pool
	}
	if c.handler != nil {
		handler = c.handler
	}
	var sub message.Subscriber
	var concurrency int
	var err error
	switch {
	case c.share:
		sub, concurrency, err = r.shareSubscriber(group, inFlight)
	case c.franz:
		sub, concurrency, err = r.franzSubscriber(group, inFlight, c.progress)
	case c.memory:
		sub, concurrency = newMemSubscriber(run.count, inFlight), inFlight
	default:
		sub, concurrency, err = r.subscriber(c.parallel, c.progress, group, inFlight)
	}
	if err != nil {
		return res, err
	}
	defer sub.Close()
	d, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: group, Table: r.table, Mode: c.mode(), Concurrency: concurrency}, nil)
	if err != nil {
		return res, err
	}
	done := newSpan(run.count)
	if run.steady {
		done = newSteadySpan(run.count)
	}
	mw := d.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })
	if run.raw {
		mw = func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) }
	}
	if err := routeUntilDone(ctx, group, run.topic, sub, run.handle(mw, done), done, c.name); err != nil {
		return res, err
	}
	res.rate = done.rate()
	if run.steady {
		res.rate = done.steadyRate()
	}
	res.stats = d.Stats()
	if ps, ok := sub.(*parallel.Subscriber); ok {
		res.refetched = ps.Stats().Refetched
	}
	return res, nil
}

// subscriber is the parallel subscriber (MaxInFlight inFlight; the dedup's
// Concurrency is returned with it) or watermill-kafka's; with progress it
// keeps the group's position in the rig's database.
func (r *parRig) subscriber(par, progress bool, group string, inFlight int) (message.Subscriber, int, error) {
	logger := watermill.NopLogger{}
	client := idemkafka.ClientConfig{Brokers: r.brokers}
	if progress {
		client.Progress, client.ProgressSchema = r.db.Pool, r.table.Schema
	}
	if par {
		// A partition's window holds at least its share of MaxInFlight
		// (the default, 1,024, holds 4,096 over the rig's 4 partitions).
		window := max(1024, inFlight/parPartitions)
		cfg := parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: r.brokers}, ConsumerGroup: group, MaxInFlight: inFlight, PartitionWindow: window}
		if progress {
			cfg.Progress, cfg.ProgressSchema = r.db.Pool, r.table.Schema
		}
		s, err := parallel.NewSubscriber(cfg, logger)
		if err != nil {
			return nil, 0, err
		}
		return s, s.MaxInFlight(), nil
	}
	cfg, err := idemkafka.WatermillSubscriberConfig(client, group)
	if err != nil {
		return nil, 0, err
	}
	s, err := kafka.NewSubscriber(cfg, logger)
	return s, 0, err
}

// handle wraps mw: it marks done, counts the warm-up events and records
// each measured event's latencies.
func (run parRun) handle(mw message.HandlerFunc, done *span) func(*message.Message) error {
	var warm atomic.Int64
	return func(msg *message.Message) error {
		entered := time.Now()
		done.first.CompareAndSwap(0, entered.UnixNano())
		if _, err := mw(msg); err != nil {
			return err
		}
		if msg.Metadata.Get(warmupKey) != "" {
			if warm.Add(1) == int64(run.warmup) {
				close(run.warmed)
			}
		} else if run.lat != nil {
			if sent, err := strconv.ParseInt(msg.Metadata.Get(sentAtKey), 10, 64); err == nil {
				run.lat.add(time.Since(time.Unix(0, sent)))
				if run.toHandler != nil {
					run.toHandler.add(entered.Sub(time.Unix(0, sent)))
				}
			}
		}
		if done.count.Load() < done.n {
			done.mark()
		}
		return nil
	}
}

// routeUntilDone runs a router with h on topic until done, the first
// handler error, or e2eRoundTimeout.
func routeUntilDone(ctx context.Context, group, topic string, sub message.Subscriber, h func(*message.Message) error, done *span, name string) error {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	var handlerErr atomic.Pointer[error]
	failed := make(chan struct{})
	var once sync.Once
	router.AddConsumerHandler(group, topic, sub, func(msg *message.Message) error {
		err := h(msg)
		select {
		case <-done.done:
			return err // stopping: messages cut short by the router's Close
		default:
		}
		if err != nil {
			handlerErr.CompareAndSwap(nil, &err)
			once.Do(func() { close(failed) })
		}
		return err
	})
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	var timeout error
	select {
	case <-done.done:
	case <-failed:
	case err := <-runErr:
		return err
	case <-time.After(e2eRoundTimeout):
		timeout = fmt.Errorf("bench: parallel %s: %d of %d events in %s", name, done.count.Load(), done.n, e2eRoundTimeout)
	}
	_ = router.Close()
	<-runErr
	if p := handlerErr.Load(); p != nil {
		return *p
	}
	return timeout
}

// warm opens every connection of the pool, so that no run pays for
// connecting.
func (r *parRig) warm(ctx context.Context) error {
	var conns []*pgxpool.Conn
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range parPoolConns {
		c, err := r.db.Pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	return nil
}

// plainSlow runs the slow handler's work in plain transactions (BEGIN;
// business row; the wait; COMMIT: no claim, no Kafka) on parMaxInFlight
// goroutines for d.
func (r *parRig) plainSlow(ctx context.Context, d time.Duration) (float64, error) {
	return Drive(ctx, parMaxInFlight, d, func(ctx context.Context, _ int) error {
		tx, err := r.db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		if _, err := tx.Exec(ctx, businessSQL, uuid.NewString(), int64(42)); err != nil {
			return err
		}
		time.Sleep(parSlowCall)
		return tx.Commit(ctx)
	})
}

// sleepHandler is the provider call alone, without a database.
func sleepHandler(msg *message.Message) error {
	t := time.NewTimer(parSlowCall)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-msg.Context().Done():
		return msg.Context().Err()
	}
}

// slowHandler is a provider call of parSlowCall inside the dedup
// transaction, after the business row.
func slowHandler(msg *message.Message) error {
	ctx := msg.Context()
	if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
		return err
	}
	t := time.NewTimer(parSlowCall)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fastHandler writes one business row and one outbox row, registered with
// idem.Complete: at once in transaction mode, in the completing
// transaction in lease mode.
func (r *parRig) fastHandler(msg *message.Message) error {
	return idem.Complete(msg.Context(), func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return err
		}
		p, err := r.ob.PublisherFromContext(ctx)
		if err != nil {
			return err
		}
		return p.Publish(r.outT, message.NewMessage(watermill.NewUUID(), msg.Payload))
	})
}

// parWorkload is one comparison: consumers (the first is the baseline)
// over one backlog, each counting its first counts[i] events.
type parWorkload struct {
	name    string
	target  float64 // the candidate's ratio to the baseline (consumers[1] / consumers[0])
	handler func(*message.Message) error
	raw     bool // without the dedup middleware
	short   bool // also in a -short run
	latency bool // measure the latency at half the rate
	// latencyTarget bounds the candidate's p99 latency as a multiple of
	// the baseline's; 0 for none.
	latencyTarget float64
	backlog       int
	counts        []int
	consumers     []parConsumer
	// ceiling, when set, is measured in the same rotation and reported
	// as a row of its own: what the database gives without Kafka and
	// without the claim.
	ceiling     func() (float64, error)
	ceilingName string
}

func parallelSubscriber(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	if err := r.warm(ctx); err != nil {
		return Section{}, err
	}
	n := parSizes{rounds: o.Rounds, slowN: 4000, slowBase: 400, fastN: 4000, latFor: 3 * time.Second}
	if o.Short {
		n = parSizes{rounds: 2, slowN: 600, slowBase: 60, fastN: 800, latFor: 500 * time.Millisecond}
	}
	var rows, latRows [][]string
	for _, w := range r.parWorkloads(ctx, o, n) {
		if o.Short && !w.short {
			continue
		}
		in, err := r.topic("bench-par-in")
		if err != nil {
			return Section{}, err
		}
		if err := r.produce(in, w.backlog, 0); err != nil {
			return Section{}, err
		}
		wrows, rates, err := r.parMeasure(ctx, o, w, in, n.rounds)
		if err != nil {
			return Section{}, err
		}
		rows = append(rows, wrows...)
		if w.latency {
			rows, err := r.latencyRows(ctx, o, w, rates, n.latFor)
			if err != nil {
				return Section{}, err
			}
			latRows = append(latRows, rows...)
		}
	}
	return Section{Title: "Parallel subscriber (idemkafka) against watermill-kafka's subscriber", Markdown: parallelMarkdown(o, n, rows, latRows)}, nil
}

// parSizes are the parallel section's rounds, backlogs and latency run.
type parSizes struct {
	rounds, slowN, slowBase, fastN int
	latFor                         time.Duration
}

// parWorkloads: the waiting handler (with its ceiling), the same wait
// without a database, and the fast handler.
func (r *parRig) parWorkloads(ctx context.Context, o Options, n parSizes) []parWorkload {
	// The consumers keep their position in PostgreSQL, as docs/guarantees.md
	// recommends (the names stay those of bench/compare's earlier commits).
	watermillKafka := parConsumer{name: "watermill-kafka subscriber, one transaction per message", progress: true}
	parSingle := parConsumer{name: fmt.Sprintf("parallel subscriber (MaxInFlight %d), one transaction per message", parMaxInFlight), parallel: true, progress: true}
	parGroup := parConsumer{name: fmt.Sprintf("parallel subscriber (MaxInFlight %d), group commit (defaults)", parMaxInFlight), parallel: true, groupCommit: &idem.GroupCommitConfig{}, progress: true}
	return []parWorkload{
		{name: fmt.Sprintf("handler waits %s", parSlowCall), target: 15, handler: slowHandler, backlog: n.slowN, short: true, latency: true, latencyTarget: 1.25,
			counts: []int{n.slowBase, n.slowN}, consumers: []parConsumer{watermillKafka, parSingle},
			ceilingName: fmt.Sprintf("ceiling: %d plain transactions at once (business row, the wait, COMMIT; no Kafka, no claim)", parMaxInFlight),
			ceiling:     func() (float64, error) { return r.plainSlow(ctx, measureFor(o, 3*time.Second, 600*time.Millisecond)) }},
		{name: fmt.Sprintf("handler waits %s, no database (the subscribers alone)", parSlowCall), handler: sleepHandler, raw: true, backlog: n.slowN,
			counts: []int{n.slowBase, n.slowN}, consumers: []parConsumer{{name: "watermill-kafka subscriber"}, {name: fmt.Sprintf("parallel subscriber (MaxInFlight %d)", parMaxInFlight), parallel: true}}},
		{name: "fast handler (business row + outbox row)", target: 2.5, handler: r.fastHandler, backlog: n.fastN, short: true, latency: true,
			counts: []int{n.fastN, n.fastN, n.fastN}, consumers: []parConsumer{watermillKafka, parGroup, parSingle}},
	}
}

// parMeasure runs w's consumers (and its ceiling) on topic in, rotated, and
// returns its table rows and the rates per variant and round.
func (r *parRig) parMeasure(ctx context.Context, o Options, w parWorkload, in string, rounds int) ([][]string, [][]float64, error) {
	var rows [][]string
	sizes := make([][]float64, len(w.consumers))
	refetched := make([][]float64, len(w.consumers))
	variants := make([]func() (float64, error), len(w.consumers))
	for i, c := range w.consumers {
		variants[i] = func() (float64, error) {
			res, err := r.run(ctx, c, parRun{topic: in, count: w.counts[i], handler: w.handler, raw: w.raw})
			if err != nil {
				return 0, fmt.Errorf("%s, %s: %w", w.name, c.name, err)
			}
			if c.groupCommit != nil {
				sizes[i] = append(sizes[i], meanGroup(idem.Stats{}, res.stats))
			}
			refetched[i] = append(refetched[i], float64(res.refetched))
			return res.rate, nil
		}
	}
	if w.ceiling != nil {
		variants = append(variants, w.ceiling)
	}
	rates, err := Rotate(rounds, variants...)
	if err != nil {
		return nil, nil, err
	}
	rows = append(rows, []string{w.name, w.consumers[0].name, fmt.Sprint(w.counts[0]), fmtRate(rates[0]), "1", "–", "–", readAgain(w.consumers[0], refetched[0])})
	for i, c := range w.consumers[1:] {
		i++
		st := Summarise(Ratios(rates[0], rates[i]))
		target := "–"
		if i == 1 && w.target > 0 {
			target = fmt.Sprintf("≥ %g×: %s", w.target, pass(st.Median >= w.target))
		}
		group := "–"
		if c.groupCommit != nil {
			group = median(sizes[i])
		}
		o.Logf("  parallel, %s, %s: %s msg/s, baseline %s msg/s, ratio %s (mean group %s)", w.name, c.name, fmtRate(rates[i]), fmtRate(rates[0]), st, group)
		rows = append(rows, []string{w.name, c.name, fmt.Sprint(w.counts[i]), fmtRate(rates[i]), st.String(), group, target, readAgain(c, refetched[i])})
	}
	if w.ceiling != nil {
		i := len(w.consumers)
		st := Summarise(Ratios(rates[0], rates[i]))
		cand := Summarise(Ratios(rates[i], rates[1]))
		o.Logf("  parallel, %s, %s: %s msg/s, ratio %s; the candidate reaches %s of it", w.name, w.ceilingName, fmtRate(rates[i]), st, cand)
		rows = append(rows, []string{w.name, w.ceilingName, "–", fmtRate(rates[i]), st.String(), "–",
			fmt.Sprintf("the parallel subscriber reaches %s of it", cand), "–"})
	}
	return rows, rates, nil
}

// readAgain is the records c's subscriber spilled and read again from
// Kafka per run: median (min–max), "–" for watermill-kafka's. No key here
// is slow or failing: what it counts is heads queued for a MaxInFlight
// slot taken for slow ones: a second fetch per record, which a change of
// the spill rule should show here.
func readAgain(c parConsumer, xs []float64) string {
	if !c.parallel || len(xs) == 0 {
		return "–"
	}
	st := Summarise(xs)
	return fmt.Sprintf("%.0f (%.0f–%.0f)", st.Median, st.Min, st.Max)
}

// parallelMarkdown is the parallel section: the rates, the workload, then
// the latencies.
func parallelMarkdown(o Options, n parSizes, rows, latRows [][]string) string {
	rounds, slowN, slowBase, fastN, latFor := n.rounds, n.slowN, n.slowBase, n.fastN, n.latFor
	var b strings.Builder
	b.WriteString(Table([]string{"workload", "consumer", "events counted", "msg/s (median)", "ratio to watermill-kafka", "mean group size", "target", "records read again from Kafka (median, min–max)"}, rows))
	fmt.Fprintf(&b, "\nKafka (%s, %d partitions, %d keys: key-(i mod %d)) → watermill Router → dedup middleware → handler; "+
		"pool of %d connections for every consumer; every consumer behind the middleware keeps its group's position in PostgreSQL "+
		"(`idemkafka.ClientConfig.Progress`, `parallel.SubscriberConfig.Progress`: one write per flush, none per transaction; docs/guarantees.md). The handler writes one business row and then either waits %s "+
		"(a provider call inside the transaction, as a billing handler does) or writes one outbox row "+
		"(`outbox.PublisherFromContext`; no forwarder runs). Each run consumes a backlog (%d events with the waiting "+
		"handler, %d with the fast one; the same for every run of a workload) with a new consumer group and a new dedup consumer group; its rate runs from the first "+
		"event handled to the last one of the count committed. watermill-kafka's subscriber on the waiting handler counts "+
		"only the first %d events (draining %d at its ~%d msg/s would take %s a round; its rate is flat, partitions / "+
		"handler time, and stopping early spares it the tail); the parallel subscriber drains the whole backlog, its tail "+
		"included. The parallel subscriber declares `idem.Config.Concurrency: sub.MaxInFlight()`. Two rows bound the "+
		"waiting workload: \"no database\" is the same wait without the dedup middleware and without PostgreSQL (the "+
		"subscribers alone: at most %d against %d messages per wait, %d×), and the ceiling is %d goroutines running the handler's work in plain "+
		"transactions (BEGIN, business row, the wait, COMMIT) on the same pool, without Kafka and without the claim: "+
		"what this machine's PostgreSQL gives at that concurrency. %d rounds, the variants' order rotated each round; "+
		"ratios are of the same round.\n\n",
		kafkaDesc(o.Brokers), parPartitions, parKeys, parKeys, parPoolConns, parSlowCall, slowN, fastN, slowBase, slowN,
		int(parPartitions*time.Second/parSlowCall), time.Duration(slowN)*parSlowCall/parPartitions, parMaxInFlight, parPartitions, parMaxInFlight/parPartitions, parMaxInFlight, rounds)
	b.WriteString("The last column counts the records the parallel subscriber spilled and read again from Kafka in a run: no key " +
		"here is slow or failing, and a partition with ready records of its own spills nothing, so it should be 0 " +
		"(before issue 50's fix, heads queued for a slot behind the backlog were taken for slow ones and their keys' records re-read).\n\n")
	fmt.Fprintf(&b, "Latency from publish to commit of each event (its wait behind earlier events of its key, and of its partition "+
		"with watermill-kafka, included), with events published for %s at half the consumer's median rate above, on a fresh "+
		"topic while it consumes, after %d warm-up events (the consumer group joined, the partitions fetched, connections open; "+
		"without them an event published during the join waits for it, and the faster consumer, publishing more events in that "+
		"time, has more of them in its top percentile). \"To the handler\" runs from the publish to the router's call of the "+
		"handler, before the dedup middleware: the subscriber's share (fetch, dispatch, a MaxInFlight slot). %s; the last column "+
		"is the p99 over the first row's of the same workload, round by round:\n\n", latFor, warmupEvents, latRoundsDesc(o))
	b.WriteString(Table([]string{"workload", "consumer", "published (msg/s)", "events", "to the handler p50", "to the handler p99",
		"p50", "p99", "p99 ratio to watermill-kafka"}, latRows))
	return b.String()
}
