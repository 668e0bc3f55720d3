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
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
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
