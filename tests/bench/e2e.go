package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
	"github.com/idemkit/watermill-idempotency/internal/relaystep"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
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

// e2eRig is the broker, the database and the input topic shared by every
// round; each round consumes the whole input topic with a new consumer group
// (so every event is new to the dedup table) and forwards to a new topic.
type e2eRig struct {
	o          Options
	partitions int32
	brokers    []string
	db         *DB
	outbox     *outbox.Outbox
	table      deduplicator.TableConfig
	in         string
	n          int
	seq        atomic.Int64
	close      func()
}

func newE2ERig(ctx context.Context, o Options, n int) (*e2eRig, error) {
	return newE2ERigWith(ctx, o, n, e2ePartitions, 12)
}

// newE2ERigWith is newE2ERig with topics of the given partition count and a
// pool of maxConns connections.
func newE2ERigWith(ctx context.Context, o Options, n int, partitions, maxConns int32) (*e2eRig, error) {
	r := &e2eRig{o: o, n: n, partitions: partitions, brokers: o.Brokers, close: func() {}}
	if len(r.brokers) == 0 {
		c, err := kafkatest.NewFake()
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		r.brokers = c.ListenAddrs()
		r.close = c.Close
	}
	db, err := NewDB(ctx, o, "e2e", maxConns, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["application_name"] = c.ConnConfig.RuntimeParams["search_path"] // the schema: unique
	})
	if err != nil {
		r.close()
		return nil, err
	}
	r.db = db
	prev := r.close
	r.close = func() { db.Close(); prev() }
	r.table = deduplicator.TableConfig{Schema: db.Schema}
	if err := migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(r.table)); err != nil {
		r.close()
		return nil, err
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE bench_order (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref text NOT NULL, amount bigint NOT NULL)"); err != nil {
		r.close()
		return nil, err
	}
	if r.outbox, err = outbox.New(outbox.Config{Schema: db.Schema}, nil); err != nil {
		r.close()
		return nil, err
	}
	if r.in, err = r.topic("bench-in"); err != nil {
		r.close()
		return nil, err
	}
	if err := r.produce(r.in, n, 0); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// topic creates a unique topic with the rig's partition count.
func (r *e2eRig) topic(prefix string) (string, error) {
	name := fmt.Sprintf("%s-%d-%s", prefix, r.seq.Add(1), uuid.NewString()[:8])
	return name, kafkatest.CreateTopic(r.brokers, name, r.partitions)
}

// produce publishes n events (UUIDv7 event id, 64 aggregates as partition
// keys, the send time in sentAtKey) with the idempotent producer. With rate
// > 0 they are paced at rate per second, else sent in batches of 500.
func (r *e2eRig) produce(topic string, n int, rate float64) error {
	return r.produceMarked(topic, n, rate, false)
}

// warmupEvents is how many warm-up events a paced round publishes first.
const warmupEvents = 64

// produceMarked is produce; warmup marks every event with warmupKey.
func (r *e2eRig) produceMarked(topic string, n int, rate float64, warmup bool) error {
	p, err := sarama.NewSyncProducer(r.brokers, idemkafka.SaramaProducerConfig(nil))
	if err != nil {
		return err
	}
	defer p.Close()
	m := idemkafka.Marshaler{}
	batch := 500
	var interval time.Duration
	if rate > 0 {
		batch = 1
		interval = time.Duration(float64(time.Second) / rate)
	}
	start := time.Now()
	var pending []*sarama.ProducerMessage
	for i := 0; i < n; i++ {
		id := uuid.Must(uuid.NewV7())
		msg := message.NewMessage(id.String(), []byte(`{"amount":42}`))
		msg.Metadata.Set(publisher.MetadataEventID, id.String())
		publisher.WithPartitionKey(msg, "agg-"+strconv.Itoa(i%64))
		if interval > 0 {
			if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
				time.Sleep(d)
			}
		}
		msg.Metadata.Set(sentAtKey, strconv.FormatInt(time.Now().UnixNano(), 10))
		if warmup {
			msg.Metadata.Set(warmupKey, "1")
		}
		pm, err := m.Marshal(topic, msg)
		if err != nil {
			return err
		}
		if pending = append(pending, pm); len(pending) == batch || i == n-1 {
			if err := p.SendMessages(pending); err != nil {
				return err
			}
			pending = pending[:0]
		}
	}
	return nil
}

// refusing is the router's publisher: with the outbox in the middleware it
// must never be called.
type refusing struct{}

func (refusing) Publish(string, ...*message.Message) error {
	return errors.New("bench: router publisher called; messages should go to the outbox")
}
func (refusing) Close() error { return nil }

// runRouter consumes topic with a new consumer group through h until done
// is closed, and returns the first handler error.
func (r *e2eRig) runRouter(ctx context.Context, topic, group, outTopic string, h message.HandlerFunc, done <-chan struct{}) error {
	return r.runRouterOn(ctx, nil, topic, group, outTopic, h, done)
}

// runRouterOn is runRouter on sub; nil means a watermill-kafka subscriber.
// It closes sub.
func (r *e2eRig) runRouterOn(ctx context.Context, sub message.Subscriber, topic, group, outTopic string, h message.HandlerFunc, done <-chan struct{}) error {
	logger := watermill.NopLogger{}
	if sub == nil {
		subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: r.brokers}, group)
		if err != nil {
			return err
		}
		if sub, err = kafka.NewSubscriber(subCfg, logger); err != nil {
			return err
		}
	}
	defer sub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	var handlerErr atomic.Pointer[error]
	failed := make(chan struct{})
	var once sync.Once
	wrapped := func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err != nil {
			handlerErr.CompareAndSwap(nil, &err)
			once.Do(func() { close(failed) })
		}
		return out, err
	}
	if outTopic == "" {
		router.AddConsumerHandler(group, topic, sub, func(msg *message.Message) error { _, err := wrapped(msg); return err })
	} else {
		router.AddHandler(group, topic, sub, outTopic, refusing{}, wrapped)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	var timeout error
	select {
	case <-done:
	case <-failed:
	case err := <-runErr:
		return err
	case <-time.After(e2eRoundTimeout):
		timeout = fmt.Errorf("bench: end-to-end round did not finish in %s", e2eRoundTimeout)
	}
	_ = router.Close()
	<-runErr
	if p := handlerErr.Load(); p != nil {
		return *p
	}
	return timeout
}

// e2eRoundTimeout bounds one round; a transaction left open elsewhere on the
// server holds the forwarder back (see xminHolder).
const e2eRoundTimeout = 60 * time.Second

// span records the first and last of n events (and, when made by
// newSteadySpan, the time of every mark).
type span struct {
	n           int64
	count       atomic.Int64
	first, last atomic.Int64
	at          []atomic.Int64
	done        chan struct{}
}

// newSteadySpan is a span that also records each mark's time, for
// steadyRate.
func newSteadySpan(n int) *span {
	s := newSpan(n)
	s.at = make([]atomic.Int64, n)
	return s
}

func newSpan(n int) *span { return &span{n: int64(n), done: make(chan struct{})} }

func (s *span) mark() {
	now := time.Now().UnixNano()
	s.first.CompareAndSwap(0, now)
	c := s.count.Add(1)
	if s.at != nil && c <= s.n {
		s.at[c-1].Store(now)
	}
	if c == s.n {
		s.last.Store(now)
		close(s.done)
	}
}

// rate is events per second from the first to the last mark.
func (s *span) rate() float64 {
	return float64(s.n-1) / time.Duration(s.last.Load()-s.first.Load()).Seconds()
}

// steadyRate is events per second between the 10th and the 90th
// percentile of the marks (a span made by newSteadySpan): the rate once the
// pipeline is full, without the time before the first completion (one
// handler's latency) and the tail after the last batch was read.
func (s *span) steadyRate() float64 {
	i, j := int(s.n/10), int(s.n*9/10)-1
	return float64(j-i) / time.Duration(s.at[j].Load()-s.at[i].Load()).Seconds()
}

// ceiling consumes the input topic with a no-op handler and no database.
func (r *e2eRig) ceiling(ctx context.Context) (float64, error) {
	sp := newSpan(r.n)
	h := func(*message.Message) ([]*message.Message, error) { sp.mark(); return nil, nil }
	if err := r.runRouter(ctx, r.in, fmt.Sprintf("bench-ceiling-%d", r.seq.Add(1)), "", h, sp.done); err != nil {
		return 0, err
	}
	return sp.rate(), nil
}

// e2eResult is one pipeline round.
type e2eResult struct {
	consumed  float64 // first handled to last committed (router + dedup + row + outbox)
	forwarded float64 // first handled to last forwarded record read back; 0 if incomplete
	// complete is false when not every record was forwarded within the
	// wait after consumption ended (see xminHolder).
	complete     bool
	forwardedNum int64
	latencies    []time.Duration
	// toKafka is the outbox's own share: from the handler's publish (the
	// event handed to the outbox inside the dedup transaction) to the
	// broker's acknowledgement of the forwarded record (ackTimer).
	toKafka []time.Duration
	// toCommit is the part of toKafka before the dedup transaction's
	// COMMIT returned to the handler's middleware.
	toCommit []time.Duration
	stats    idem.Stats // the middleware's counters at the end
}

// pipelineSpec describes one pipeline round.
type pipelineSpec struct {
	in          string
	n           int
	produceRate float64
	poll        time.Duration
	fwdWait     time.Duration
	// notify enables the outbox table's notify trigger (the writers send
	// NOTIFY) and the forwarder's Listen.
	notify bool
	// groupCommit, when set, is the middleware's Config.GroupCommit.
	groupCommit *idem.GroupCommitConfig
	// inMiddleware, when set, is called with each successful message's
	// time inside the dedup middleware (arrival to result).
	inMiddleware func(time.Duration)
	// parallel > 0 consumes with the parallel subscriber at that
	// MaxInFlight instead of watermill-kafka's.
	parallel int
	// observe, when set, gets the forwarder's steps (relaystep); committed
	// and acked, when set, get each measured row of a paced round, by its
	// publish time (publishedAtKey): when the dedup transaction's COMMIT
	// returned, and when the broker acknowledged the forwarded record.
	observe          relaystep.Observer
	committed, acked func(publishedAt int64, at time.Time)
	// serial runs the forwarder as before its reads were pipelined
	// (relaystep.WithSerial).
	serial bool
}

// pipelineWith is one pipeline round as described by s.
func (r *e2eRig) pipelineWith(ctx context.Context, s pipelineSpec) (e2eResult, error) {
	in, n, produceRate, poll, fwdWait := s.in, s.n, s.produceRate, s.poll, s.fwdWait
	var res e2eResult
	out, err := r.topic("bench-out")
	if err != nil {
		return res, err
	}
	if err := migrateTopic(ctx, r.db.Pool, r.outbox, out); err != nil {
		return res, err
	}
	if s.notify {
		if _, err := r.db.Pool.Exec(ctx, "ALTER TABLE "+r.outbox.MessagesTable(out)+" ENABLE TRIGGER idem_outbox_notify"); err != nil {
			return res, err
		}
	}
	group := fmt.Sprintf("bench-e2e-%d", r.seq.Add(1))
	var sub message.Subscriber
	if s.parallel > 0 {
		ps, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: r.brokers}, ConsumerGroup: group, MaxInFlight: s.parallel}, nil)
		if err != nil {
			return res, err
		}
		sub = ps
		defer ps.Close() // runRouterOn closes it too: twice is harmless
	}
	dedup, err := idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: group, Table: r.table, Outbox: r.outbox, GroupCommit: s.groupCommit, Concurrency: s.parallel}, nil)
	if err != nil {
		return res, err
	}
	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: r.brokers})
	if err != nil {
		return res, err
	}
	defer producer.Close()
	var toKafkaMu sync.Mutex
	acked := ackTimer{SyncProducer: producer, acked: func(publishedAt int64, at time.Time) {
		toKafkaMu.Lock()
		res.toKafka = append(res.toKafka, at.Sub(time.Unix(0, publishedAt)))
		toKafkaMu.Unlock()
		if s.acked != nil {
			s.acked(publishedAt, at)
		}
	}}
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: r.db.Pool, Outbox: r.outbox, Producer: acked, Topics: []string{out}, PollInterval: poll, Listen: s.notify}, nil)
	if err != nil {
		return res, err
	}
	fctx, stopFwd := context.WithCancel(ctx)
	fwdErr := make(chan error, 1)
	runCtx := fctx
	if s.observe != nil {
		runCtx = relaystep.With(runCtx, s.observe)
	}
	if s.serial {
		runCtx = relaystep.WithSerial(runCtx)
	}
	go func() { fwdErr <- fwd.Run(runCtx) }()
	defer func() { stopFwd(); <-fwdErr }()

	consumed, forwarded := newSpan(n), newSpan(n)
	res.latencies = make([]time.Duration, 0, n)
	stopRead, readErr := r.readAll(out, n, func(sentAt, publishedAt int64, now time.Time) {
		res.latencies = append(res.latencies, now.Sub(time.Unix(0, sentAt)))
		forwarded.mark()
	})
	defer stopRead()

	var publishedAt sync.Map // input message UUID → the handler's publish time
	inner := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return nil, err
		}
		fwdMsg := message.NewMessage(watermill.NewUUID(), msg.Payload)
		fwdMsg.Metadata.Set(sentAtKey, msg.Metadata.Get(sentAtKey))
		if msg.Metadata.Get(warmupKey) != "" {
			fwdMsg.Metadata.Set(warmupKey, "1")
		}
		publisher.WithPartitionKey(fwdMsg, msg.Metadata.Get(publisher.MetadataPartitionKey))
		now := time.Now()
		fwdMsg.Metadata.Set(publishedAtKey, strconv.FormatInt(now.UnixNano(), 10))
		if produceRate > 0 {
			publishedAt.Store(msg.UUID, now)
		}
		return []*message.Message{fwdMsg}, nil
	}
	mw := dedup.Middleware(inner)
	warmedUp, warm := make(chan struct{}), atomic.Int64{}
	var toCommitMu sync.Mutex
	h := func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(warmupKey) != "" {
			out, err := mw(msg)
			if err == nil && warm.Add(1) == warmupEvents {
				close(warmedUp)
			}
			return out, err
		}
		if consumed.first.Load() == 0 {
			consumed.first.CompareAndSwap(0, time.Now().UnixNano())
			forwarded.first.CompareAndSwap(0, consumed.first.Load())
		}
		start := time.Now()
		out, err := mw(msg)
		if err == nil {
			if s.inMiddleware != nil {
				s.inMiddleware(time.Since(start))
			}
			consumed.mark() // after COMMIT
			if at, ok := publishedAt.LoadAndDelete(msg.UUID); ok {
				now := time.Now()
				toCommitMu.Lock()
				res.toCommit = append(res.toCommit, now.Sub(at.(time.Time)))
				toCommitMu.Unlock()
				if s.committed != nil {
					s.committed(at.(time.Time).UnixNano(), now)
				}
			}
		}
		return out, err
	}
	// A paced round measures a running pipeline: warm-up events first (the
	// consumer group joined, partitions fetched, pools and the forwarder's
	// connections opened), then the measured ones.
	if produceRate > 0 {
		if err := r.produceMarked(in, warmupEvents, 0, true); err != nil {
			return res, err
		}
		go func() {
			select {
			case <-warmedUp:
				_ = r.produce(in, n, produceRate)
			case <-ctx.Done():
			}
		}()
	}
	// Stop when everything was forwarded, or fwdWait after the consuming
	// side finished.
	stop := make(chan struct{})
	go func() {
		defer close(stop)
		select {
		case <-forwarded.done:
			return
		case <-consumed.done:
		case <-ctx.Done():
			return
		}
		t := time.NewTimer(fwdWait)
		defer t.Stop()
		select {
		case <-forwarded.done:
		case <-t.C:
		}
	}()
	if err := r.runRouterOn(ctx, sub, in, group, out, h, stop); err != nil {
		return res, fmt.Errorf("%w (handled %d, forwarded %d of %d)", err, consumed.count.Load(), forwarded.count.Load(), n)
	}
	stopRead()
	if err := readErr(); err != nil {
		return res, err
	}
	// Stop the forwarder before reading toKafka (deferred too: twice is
	// harmless).
	stopFwd()
	<-fwdErr
	fwdErr <- nil
	if consumed.count.Load() < int64(n) {
		return res, fmt.Errorf("bench: end-to-end round stopped after %d of %d events", consumed.count.Load(), n)
	}
	res.consumed = consumed.rate()
	res.stats = dedup.Stats()
	res.forwardedNum = forwarded.count.Load()
	if res.complete = res.forwardedNum == int64(n); res.complete {
		res.forwarded = forwarded.rate()
	}
	return res, nil
}

// xminHolder describes the oldest transaction on the server that holds the
// snapshot xmin back, if it is older than a second: the forwarder only reads
// outbox rows below the xmin, so such a transaction (in any database of the
// cluster) delays every forward.
func (r *e2eRig) xminHolder(ctx context.Context) string {
	var age float64
	var state string
	err := r.db.Pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - xact_start), coalesce(state, '')
		FROM pg_stat_activity
		WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) AND pid <> pg_backend_pid()
		ORDER BY xact_start LIMIT 1`).Scan(&age, &state)
	if err != nil || age < 1 {
		return ""
	}
	return fmt.Sprintf("a transaction open for %.0f s (%s)", age, state)
}

// readAll consumes every partition of topic from the start and calls got
// (from one goroutine at a time) for each of the first n records, warm-up
// records (warmupKey) left out.
func (r *e2eRig) readAll(topic string, n int, got func(sentAt, publishedAt int64, now time.Time)) (stop func(), errf func() error) {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0
	c, err := sarama.NewConsumer(r.brokers, cfg)
	if err != nil {
		return func() {}, func() error { return err }
	}
	var (
		mu    sync.Mutex
		count int
		wg    sync.WaitGroup
		rerr  error
	)
	quit := make(chan struct{})
	for p := int32(0); p < r.partitions; p++ {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			close(quit)
			wg.Wait()
			_ = c.Close()
			return func() {}, func() error { return err }
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer pc.Close()
			for {
				select {
				case <-quit:
					return
				case m := <-pc.Messages():
					now := time.Now()
					var sentAt, publishedAt int64
					warmup := false
					for _, h := range m.Headers {
						switch string(h.Key) {
						case sentAtKey:
							sentAt, _ = strconv.ParseInt(string(h.Value), 10, 64)
						case publishedAtKey:
							publishedAt, _ = strconv.ParseInt(string(h.Value), 10, 64)
						case warmupKey:
							warmup = true
						}
					}
					if warmup {
						continue
					}
					mu.Lock()
					if (sentAt == 0 || publishedAt == 0) && rerr == nil {
						rerr = errors.New("bench: forwarded record without " + sentAtKey + " or " + publishedAtKey)
					}
					if count < n {
						count++
						got(sentAt, publishedAt, now)
					}
					mu.Unlock()
				}
			}
		}()
	}
	var once sync.Once
	return func() {
			once.Do(func() { close(quit); wg.Wait(); _ = c.Close() })
		}, func() error {
			mu.Lock()
			defer mu.Unlock()
			return rerr
		}
}

// ackTimer is the forwarder's producer, timing each measured record's
// acknowledgement: the moment SendMessages returned for its batch, i.e. the
// broker had the record (acks=all). acked gets the record's publishedAtKey
// value and that moment; warm-up records are not timed.
type ackTimer struct {
	sarama.SyncProducer
	acked func(publishedAt int64, at time.Time)
}

func (a ackTimer) SendMessages(msgs []*sarama.ProducerMessage) error {
	if err := a.SyncProducer.SendMessages(msgs); err != nil {
		return err
	}
	now := time.Now()
	for _, m := range msgs {
		var publishedAt int64
		warmup := false
		for _, h := range m.Headers {
			switch string(h.Key) {
			case publishedAtKey:
				publishedAt, _ = strconv.ParseInt(string(h.Value), 10, 64)
			case warmupKey:
				warmup = true
			}
		}
		if !warmup && publishedAt != 0 {
			a.acked(publishedAt, now)
		}
	}
	return nil
}

func (a ackTimer) SendMessage(m *sarama.ProducerMessage) (int32, int64, error) {
	err := a.SendMessages([]*sarama.ProducerMessage{m})
	return m.Partition, m.Offset, err
}

func percentile(xs []time.Duration, p float64) time.Duration {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(p * float64(len(s)-1))
	return s[i]
}

func endToEnd(ctx context.Context, o Options) (Section, error) {
	n, rounds, liveN, slowN, fwdWait := 6000, 3, 4000, 200, 10*time.Second
	if o.Short {
		n, rounds, liveN, slowN, fwdWait = 1500, 2, 500, 60, 5*time.Second
	}
	const slowRate = 20
	r, err := newE2ERig(ctx, o, n)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	holders := []string{r.xminHolder(ctx)}

	var forwarded, consumed, consumedNotify, parForwarded, wkForwarded []float64
	incomplete := 0
	round := func(notify bool) func() (float64, error) {
		return func() (float64, error) {
			res, err := r.pipelineWith(ctx, pipelineSpec{in: r.in, n: n, fwdWait: fwdWait, notify: notify})
			if err != nil {
				return 0, err
			}
			if notify {
				consumedNotify = append(consumedNotify, res.consumed)
				return res.consumed, nil
			}
			consumed = append(consumed, res.consumed)
			wkForwarded = append(wkForwarded, res.forwarded)
			if res.complete {
				forwarded = append(forwarded, res.forwarded)
			} else {
				incomplete++
				o.Logf("  end-to-end: only %d of %d records forwarded within %s after consumption ended", res.forwardedNum, n, fwdWait)
			}
			return res.consumed, nil
		}
	}
	// The parallel subscriber with group commit, forwarded and read back,
	// against the watermill-kafka row's forwarded rate of the same round
	// (0 for a round not forwarded within fwdWait).
	parRound := func() (float64, error) {
		res, err := r.pipelineWith(ctx, pipelineSpec{in: r.in, n: n, fwdWait: fwdWait, groupCommit: &idem.GroupCommitConfig{}, parallel: parMaxInFlight})
		if err != nil {
			return 0, fmt.Errorf("parallel subscriber, group commit: %w", err)
		}
		parForwarded = append(parForwarded, res.forwarded)
		return res.consumed, nil
	}
	rates, err := Rotate(rounds, func() (float64, error) { return r.ceiling(ctx) }, round(false), round(true), parRound)
	if err != nil {
		return Section{}, err
	}
	base := rates[0]
	ratios, withNotifyRatios, notifyRatios := Ratios(base, consumed), Ratios(base, consumedNotify), Ratios(consumed, consumedNotify)
	var fwdRatios []float64
	if incomplete == 0 {
		fwdRatios = Ratios(base, forwarded)
	}
	holders = append(holders, r.xminHolder(ctx))
	cst := Summarise(ratios)
	o.Logf("  end-to-end: ceiling %s msg/s, consumed %s msg/s (ratio %s; with NOTIFY %s), forwarded %v msg/s", fmtRate(base), fmtRate(consumed), cst, Summarise(withNotifyRatios), forwarded)

	rows := [][]string{
		{"no-op handler, no database (ceiling)", fmtRate(base), "1"},
		{"dedup + business row + outbox row, committed", fmtRate(consumed), cst.String()},
		{"… the same with the outbox's notify trigger enabled (NOTIFY at commit, forwarder Listen)", fmtRate(consumedNotify), Summarise(withNotifyRatios).String()},
	}
	if incomplete == 0 {
		rows = append(rows, []string{"… and forwarded to Kafka by the forwarder, read back", fmtRate(forwarded), Summarise(fwdRatios).String()})
	} else {
		rows = append(rows, []string{"… and forwarded to Kafka by the forwarder, read back",
			fmt.Sprintf("not measured: %d of %d rounds not forwarded within %s", incomplete, rounds, fwdWait), "–"})
	}
	parTable := parallelE2ETable(wkForwarded, parForwarded, rates[3])
	o.Logf("  end-to-end, parallel subscriber with group commit: %s", parTable[0][3:])

	// Latency: a fresh input topic fed at half the consuming side's median
	// rate while the pipeline runs, so records do not queue behind a
	// backlog: the forwarder's defaults (wake-up on commit), the same with
	// a transaction holding an id open in another database of the server
	// for the whole measurement, and polling alone.
	liveRate := Summarise(consumed).Median / 2
	foreign, err := r.foreignHolder(ctx)
	if err != nil {
		return Section{}, err
	}
	defer foreign.close()
	var latRows [][]string
	var quietP99 time.Duration
	for _, v := range []struct {
		name   string
		notify bool
		hold   bool
		slow   bool
	}{
		{"defaults", false, false, false},
		{"defaults, a transaction holding an id open in another database all along", false, true, false},
		{"notify trigger enabled, Listen", true, false, false},
		{fmt.Sprintf("defaults, at %d msg/s (the forwarder idles between events)", slowRate), false, false, true},
	} {
		live, err := r.topic("bench-live")
		if err != nil {
			return Section{}, err
		}
		if v.hold {
			if err := foreign.hold(ctx); err != nil {
				return Section{}, err
			}
		}
		n, rate := liveN, liveRate
		if v.slow {
			n, rate = slowN, slowRate
		}
		res, err := r.pipelineWith(ctx, pipelineSpec{in: live, n: n, produceRate: rate, fwdWait: fwdWait, notify: v.notify})
		held := ""
		if v.hold {
			held, err = foreign.release(ctx, err)
		}
		if err != nil {
			return Section{}, err
		}
		if !res.complete {
			o.Logf("  end-to-end latency, %s: only %d of %d forwarded within %s", v.name, res.forwardedNum, n, fwdWait)
			latRows = append(latRows, []string{v.name, "not measured", "", "", "", fmt.Sprintf("%d of %d forwarded within %s", res.forwardedNum, n, fwdWait)})
			continue
		}
		p50, p99 := percentile(res.latencies, 0.50), percentile(res.latencies, 0.99)
		k50, k99 := percentile(res.toKafka, 0.50), percentile(res.toKafka, 0.99)
		rel := ""
		switch {
		case v.slow:
			rel = fmt.Sprintf("%d events", n)
		case quietP99 == 0:
			quietP99 = k99
			rel = "target p99 ≤ 20ms: met"
			if k99 > relayTarget {
				rel = fmt.Sprintf("target p99 ≤ 20ms: not met (+%s; load average %s; see the relay-steps section)", fmtDur(k99-relayTarget), loadAverage())
			}
		default:
			rel = fmt.Sprintf("%.2f× the first row's publish→Kafka p99", float64(k99)/float64(quietP99))
			if held != "" {
				rel += "; " + held
			}
		}
		o.Logf("  end-to-end latency at %.0f msg/s, %s: p50 %s, p99 %s (outbox publish→Kafka p50 %s p99 %s, of which publish→COMMIT returned p50 %s p99 %s)", rate, v.name, p50, p99,
			percentile(res.toKafka, 0.5), percentile(res.toKafka, 0.99), percentile(res.toCommit, 0.5), percentile(res.toCommit, 0.99))
		r := func(d time.Duration) string { return d.Round(100 * time.Microsecond).String() }
		latRows = append(latRows, []string{v.name, r(k50), r(k99), r(p50), r(p99), rel})
	}
	holders = append(holders, r.xminHolder(ctx))

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
	b.WriteString(Table([]string{"workload", "subject", "baseline", "msg/s (median)", "ratio to baseline", "target"}, parTable))
	fmt.Fprintf(&b, "\nThe same pipeline on the parallel subscriber (MaxInFlight %d, `idem.Config.Concurrency: sub.MaxInFlight()`) with "+
		"`Config.GroupCommit` at its defaults, in the same rotation as the rows above (same backlog, pool and forwarder); "+
		"rate from the first handled event to the last forwarded record read back; ratio = its rate / the watermill-kafka "+
		"row's forwarded rate of the same round (the fourth row above).\n\n", parMaxInFlight)
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
	return Section{Title: "End to end: Kafka → dedup → Postgres → outbox → forwarder → Kafka", Markdown: b.String()}, nil
}

func kafkaDesc(brokers []string) string {
	if len(brokers) == 0 {
		return "in-process kfake broker over TCP"
	}
	return strings.Join(brokers, ",")
}

// foreignTx holds a transaction with a transaction id open in a database of
// its own on the same server, as another service's long transaction would.
type foreignTx struct {
	admin, conn *pgx.Conn
	name        string
	tx          pgx.Tx
	pid         uint32
	xid         string
	began       time.Time
}

// foreignHolder creates the database bench_foreign_<schema>.
func (r *e2eRig) foreignHolder(ctx context.Context) (*foreignTx, error) {
	name := "bench_foreign_" + strings.TrimPrefix(r.db.Schema, "bench_")
	admin, err := pgx.Connect(ctx, r.o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		_ = admin.Close(ctx)
		return nil, fmt.Errorf("create database %s: %w", name, err)
	}
	f := &foreignTx{admin: admin, name: name}
	cfg, err := pgx.ParseConfig(r.o.DatabaseURL)
	if err != nil {
		f.close()
		return nil, err
	}
	cfg.Database = name
	if f.conn, err = pgx.ConnectConfig(ctx, cfg); err != nil {
		f.close()
		return nil, err
	}
	return f, nil
}

// hold begins the transaction and gives it an id.
func (f *foreignTx) hold(ctx context.Context) error {
	var err error
	if f.tx, err = f.conn.Begin(ctx); err != nil {
		return err
	}
	f.began = time.Now()
	return f.tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text, pg_backend_pid()`).Scan(&f.xid, &f.pid)
}

// release checks that the transaction still held its id, rolls it back,
// and says for how long it held it.
func (f *foreignTx) release(ctx context.Context, err error) (string, error) {
	var held string
	if qerr := f.admin.QueryRow(ctx, `SELECT coalesce(backend_xid::text, '') FROM pg_stat_activity WHERE pid = $1`, f.pid).Scan(&held); qerr != nil && err == nil {
		err = qerr
	}
	if held != f.xid && err == nil {
		err = fmt.Errorf("the foreign transaction %s did not hold its id to the end (%q)", f.xid, held)
	}
	d := time.Since(f.began)
	if rerr := f.tx.Rollback(ctx); rerr != nil && err == nil {
		err = rerr
	}
	return fmt.Sprintf("the foreign transaction held its id for %.1f s", d.Seconds()), err
}

func (f *foreignTx) close() {
	ctx := context.Background()
	if f.conn != nil {
		_ = f.conn.Close(ctx)
	}
	_, _ = f.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{f.name}.Sanitize()+" WITH (FORCE)")
	_ = f.admin.Close(ctx)
}

// parallelE2ETable is the end-to-end section's row for the parallel
// subscriber with group commit: its forwarded rate (parConsumedRates only
// for the log) against the watermill-kafka row's, round by round; a round
// either side did not forward in full is left out.
func parallelE2ETable(wkForwarded, parForwarded, parConsumedRates []float64) [][]string {
	var wk, par, ratios []float64
	for i := range min(len(wkForwarded), len(parForwarded)) {
		if wkForwarded[i] > 0 && parForwarded[i] > 0 {
			wk, par = append(wk, wkForwarded[i]), append(par, parForwarded[i])
			ratios = append(ratios, parForwarded[i]/wkForwarded[i])
		}
	}
	row := []string{"Kafka → dedup → outbox → forwarder → Kafka, forwarded and read back",
		fmt.Sprintf("parallel subscriber (MaxInFlight %d), group commit (defaults)", parMaxInFlight),
		"watermill-kafka subscriber, one transaction per message (forwarded, read back)"}
	if len(ratios) == 0 {
		return [][]string{append(row, fmt.Sprintf("not measured: no round forwarded in full (committed %s msg/s)", fmtRate(parConsumedRates)), "–", "≥ 4×: not measured")}
	}
	st := Summarise(ratios)
	return [][]string{append(row, fmtRate(par), st.String(), fmt.Sprintf("≥ 4× (baseline %s msg/s): %s", fmtRate(wk), pass(st.Median >= 4)))}
}
