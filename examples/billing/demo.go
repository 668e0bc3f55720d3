package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// DemoConfig sizes the demo and its injected faults.
type DemoConfig struct {
	// DatabaseURL of the PostgreSQL server; the demo creates its own schema
	// and drops it at the end.
	DatabaseURL string
	// Brokers of a Kafka cluster; nil starts an in-process Kafka-protocol
	// broker (kfake). With a real cluster, topic and group names get a
	// per-run suffix.
	Brokers []string
	// Orders to confirm.
	Orders int
	// Partitions of orders.confirmed.
	Partitions int32
	// BillingInstances: billing consumers in the same group (partitions are
	// split between them, as between pods).
	BillingInstances int
	// RedeliverEvery: every n-th order's event is published a second time
	// with the same event id, as a producer retry or a forwarder resend after
	// a crash would. 0 disables.
	RedeliverEvery int
	// ConcurrentDuplicates: events whose copies are published on every
	// partition at once, so consumers claim the same event id concurrently.
	ConcurrentDuplicates int
	// LostResponses: orders whose charge response the provider loses after
	// charging.
	LostResponses int
	// ProviderLatency is how long a charge takes.
	ProviderLatency time.Duration
	// ConcurrentLatency is how long the charges of the ConcurrentDuplicates
	// orders take: the window in which their copies meet.
	ConcurrentLatency time.Duration
	// Timeout bounds the whole run: a deadline for when something is stuck,
	// not an expected duration. Defaults to 5 minutes (a writing transaction
	// left open anywhere on the PostgreSQL server holds the outbox forwarder
	// back until it ends; see the "forwarder waiting" hint).
	Timeout time.Duration
	// Progress receives progress lines; nil for none.
	Progress io.Writer
	// Logger for the library and Watermill; nil for none.
	Logger watermill.LoggerAdapter

	// providerIgnoresKeys makes the payment provider charge every request,
	// whatever its Idempotency-Key (tests: the invariants must catch it).
	providerIgnoresKeys bool
}

func (c *DemoConfig) setDefaults() {
	if c.Orders == 0 {
		c.Orders = 200
	}
	if c.Partitions == 0 {
		c.Partitions = 4
	}
	if c.BillingInstances == 0 {
		c.BillingInstances = 2
	}
	if c.ConcurrentLatency == 0 {
		c.ConcurrentLatency = 100 * time.Millisecond
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// GroupReport is what one consumer group's handler chain did. Deliveries,
// Rejected and Failed are counted by a wrapper around the dedup middleware;
// Processed and Skipped are the middleware's own counters ([idem.Dedup.Stats]),
// so the equation Deliveries = Processed + Skipped + Rejected + Failed checks
// the middleware's accounting against an outside observer: it breaks if the
// middleware acks a message it did not count, or counts one twice.
type GroupReport struct {
	Deliveries int64  // calls into the dedup middleware, redeliveries included
	Processed  uint64 // handler ran and the transaction committed (Dedup.Stats)
	Skipped    uint64 // duplicates: the claim found a committed row, handler not run (Dedup.Stats)
	Rejected   int64  // returned a permanent error: to the poison topic, then acked
	Failed     int64  // returned a transient error: rolled back, nacked, delivered again
	// MiddlewareErrors are the errors the middleware counted itself: refused
	// before any SQL + rolled back + BEGIN/claim errors. They must be
	// Rejected + Failed.
	MiddlewareErrors uint64
	// Records is the number of distinct Kafka records (partition, offset) of
	// the topic whose delivery ended (acked or poisoned).
	Records int
	// KafkaRedelivered counts deliveries of a record that had already been
	// delivered to this group to the end: Kafka handed it out again after a
	// rebalance, because its offset had not been committed yet. The demo
	// does not inject these; the claims absorb them.
	KafkaRedelivered int
	// InFlightSkipped are the skipped duplicates that arrived while the
	// processing copy was still in flight (its transaction open).
	InFlightSkipped int
	// NoRecord counts deliveries without a Kafka partition and offset in
	// their context (none expected).
	NoRecord int64
	Claims   int // processed_event rows of the group
	Poisoned int // records of the group on the poison topic
	// PoisonedEvents is the number of distinct messages (by UUID) among them.
	PoisonedEvents int
}

// Added is Processed + Skipped + Rejected + Failed: the deliveries as the
// middleware and the errors it returned account for them.
func (g GroupReport) Added() int64 {
	return int64(g.Processed) + int64(g.Skipped) + g.Rejected + g.Failed
}

// Report is the outcome of a run.
type Report struct {
	Orders    int
	Published int // copies the demo put on orders.confirmed: originals + injected + malformed
	// OnTopic is the number of records on orders.confirmed at the end:
	// Published, plus any batch the outbox forwarder sent twice (it is
	// at-least-once: a failed position commit resends).
	OnTopic         int
	Republished     int // injected: events published a second time
	ConcurrentSent  int // injected: copies published on every partition at once
	Malformed       int
	LostResponses   int
	Billing         GroupReport
	Notification    GroupReport
	Provider        ProviderStats
	LedgerRows      int
	Notifications   int
	ChargedOutbox   int // billing.charged.v1 rows written to the outbox
	ChargedConsumed int // distinct billing.charged.v1 event ids seen on Kafka
	Forwarded       uint64
	OutboxPruned    int64 // forwarded outbox rows deleted at the end
	PoisonReasons   []string
	Elapsed         time.Duration
	Violations      []string
}

// Injected is the number of duplicate copies the demo published on purpose.
func (r *Report) Injected() int { return r.Republished + r.ConcurrentSent }

// Resent is the number of records on orders.confirmed the demo did not
// publish: outbox rows the forwarder sent twice.
func (r *Report) Resent() int { return r.OnTopic - r.Published }

// names are the topics and groups of one run.
type names struct {
	orders, charged, poison  string
	billing, notification    string
	auditPoison, auditCharge string
}

func newNames(suffix string) names {
	return names{
		orders: TopicOrdersConfirmed + suffix, charged: TopicBillingCharged + suffix, poison: TopicPoison + suffix,
		billing: GroupBilling + suffix, notification: GroupNotification + suffix,
		auditPoison: "demo-audit-poison" + suffix, auditCharge: "demo-audit-charged" + suffix,
	}
}

// groupStats counts what one consumer group's handler chain saw, around the
// dedup middleware (outer) and the handler (inner).
type groupStats struct {
	dedup *idem.Dedup // processed and skipped: the middleware's own counters

	deliveries, rejected, failed, noRecord atomic.Int64

	mu         sync.Mutex
	ended      map[record]int         // Kafka record -> deliveries of it that ended (acked or poisoned)
	committed  map[string]time.Time   // event id -> when its processing delivery returned
	skipStarts map[string][]time.Time // event id -> when its skipped deliveries started
}

// record is a Kafka record of the consumed topic: each copy of an event is
// one, and a redelivery by Kafka is the same record again.
type record struct {
	partition int32
	offset    int64
}

type ranKey struct{}

// outer wraps the dedup middleware: it counts every delivery and classifies
// what the middleware returned.
func (s *groupStats) outer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		s.deliveries.Add(1)
		begin := time.Now()
		ctx := msg.Context()
		p, okP := kafka.MessagePartitionFromCtx(ctx)
		o, okO := kafka.MessagePartitionOffsetFromCtx(ctx)
		if !okP || !okO {
			s.noRecord.Add(1)
		}
		ran := new(atomic.Bool)
		msg.SetContext(context.WithValue(ctx, ranKey{}, ran))
		defer msg.SetContext(ctx)
		out, err := h(msg)
		switch {
		case err != nil && idem.IsPermanent(err):
			s.rejected.Add(1) // the poison queue outside publishes it, then acks
			s.end(record{p, o}, msg, begin, "")
		case err != nil:
			s.failed.Add(1) // nacked: the same record comes again
		case ran.Load():
			s.end(record{p, o}, msg, begin, "processed")
		default:
			s.end(record{p, o}, msg, begin, "skipped")
		}
		return out, err
	}
}

// inner sits between the dedup middleware and the handler: it runs only for
// the first claim of an event.
func inner(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if ran, ok := msg.Context().Value(ranKey{}).(*atomic.Bool); ok {
			ran.Store(true)
		}
		return h(msg)
	}
}

// end records a delivery that ended its record: acked (processed or
// skipped) or poisoned (outcome "").
func (s *groupStats) end(r record, msg *message.Message, begin time.Time, outcome string) {
	id := msg.Metadata.Get(publisher.MetadataEventID)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended == nil {
		s.ended, s.committed, s.skipStarts = map[record]int{}, map[string]time.Time{}, map[string][]time.Time{}
	}
	s.ended[r]++
	switch outcome {
	case "skipped":
		s.skipStarts[id] = append(s.skipStarts[id], begin)
	case "processed":
		s.committed[id] = time.Now()
	}
}

// records returns the number of distinct records whose delivery ended.
func (s *groupStats) records() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.ended)
}

// overlapping counts skipped duplicates that started while the copy that
// was processed had not returned yet: they met it in flight.
func (s *groupStats) overlapping() int {
	n := 0
	for id, starts := range s.skipStarts {
		done, ok := s.committed[id]
		for _, t := range starts {
			if ok && t.Before(done) {
				n++
			}
		}
	}
	return n
}

func (s *groupStats) report() GroupReport {
	st := s.dedup.Stats()
	s.mu.Lock()
	defer s.mu.Unlock()
	again := 0
	for _, n := range s.ended {
		again += n - 1
	}
	return GroupReport{
		Deliveries: s.deliveries.Load(), Processed: st.Processed, Skipped: st.Duplicates,
		Rejected: s.rejected.Load(), Failed: s.failed.Load(),
		MiddlewareErrors: st.Rejected.Total() + st.Failed + st.ClaimErrors,
		Records:          len(s.ended), KafkaRedelivered: again, InFlightSkipped: s.overlapping(), NoRecord: s.noRecord.Load(),
	}
}

// partitionMarshaler sends a message to the partition named in its
// "demo_partition" metadata (with a manual partitioner), to put copies of one
// event on several partitions at once.
type partitionMarshaler struct{ publisher.Marshaler }

func (m partitionMarshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.Marshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	p, err := strconv.Atoi(msg.Metadata.Get("demo_partition"))
	if err != nil {
		return nil, fmt.Errorf("demo_partition: %w", err)
	}
	pm.Partition = int32(p)
	return pm, nil
}

// RunDemo runs the whole scenario and returns its report; Violations lists
// every broken invariant. An error means the demo could not run at all.
func RunDemo(ctx context.Context, cfg DemoConfig) (rep *Report, err error) {
	cfg.setDefaults()
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	progress := func(format string, args ...any) {
		fmt.Fprintf(cfg.Progress, "[%5.1fs] "+format+"\n", append([]any{time.Since(start).Seconds()}, args...)...)
	}
	logger := cfg.Logger

	// --- PostgreSQL: a fresh schema, dropped at the end.
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	runID := hex.EncodeToString(rnd[:])
	schema := "billing_demo_" + runID
	pool, err := openSchema(ctx, cfg.DatabaseURL, schema)
	if err != nil {
		return nil, err
	}
	defer func() {
		pool.Close()
		if derr := dropSchema(cfg.DatabaseURL, schema); derr != nil && err == nil {
			err = derr
		}
	}()
	progress("PostgreSQL: schema %s", schema)

	// --- Kafka: in-process kfake unless KAFKA_BROKERS is set.
	brokers, suffix := cfg.Brokers, ""
	if len(brokers) == 0 {
		fake, err := kafkatest.NewFake()
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		defer fake.Close()
		brokers = fake.ListenAddrs()
		progress("Kafka: in-process kfake broker on %s", brokers[0])
	} else {
		suffix = "." + runID
		progress("Kafka: %v (topics and groups suffixed %q)", brokers, suffix)
	}
	n := newNames(suffix)
	for _, t := range []struct {
		name string
		p    int32
	}{{n.orders, cfg.Partitions}, {n.charged, 1}, {n.poison, 1}} {
		if err := kafkatest.CreateTopic(brokers, t.name, t.p); err != nil {
			return nil, fmt.Errorf("create topic %s: %w", t.name, err)
		}
	}

	// --- Schema: dedup table, outbox tables, business tables.
	table := deduplicator.TableConfig{Schema: schema}
	if err := deduplicator.Migrate(ctx, pool, table); err != nil {
		return nil, fmt.Errorf("migrate processed_event: %w", err)
	}
	ob, err := outbox.New(outbox.Config{Schema: schema, Topics: []string{n.orders, n.charged}}, logger)
	if err != nil {
		return nil, err
	}
	if err := ob.Migrate(ctx, pool); err != nil {
		return nil, fmt.Errorf("migrate outbox: %w", err)
	}
	if _, err := pool.Exec(ctx, schemaSQL); err != nil {
		return nil, fmt.Errorf("create business tables: %w", err)
	}

	// --- Kafka clients.
	kcfg := publisher.KafkaConfig{Brokers: brokers}
	pubCfg, err := publisher.NewKafkaPublisherConfig(kcfg)
	if err != nil {
		return nil, err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, logger) // poison queue + injected copies
	if err != nil {
		return nil, fmt.Errorf("kafka publisher: %w", err)
	}
	defer kafkaPub.Close()
	manual := sarama.NewConfig()
	manual.Producer.Partitioner = sarama.NewManualPartitioner
	partPub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers, Marshaler: partitionMarshaler{}, OverwriteSaramaConfig: publisher.SaramaProducerConfig(manual),
	}, logger)
	if err != nil {
		return nil, fmt.Errorf("kafka publisher: %w", err)
	}
	defer partPub.Close()
	producer, err := outbox.NewKafkaProducer(kcfg)
	if err != nil {
		return nil, fmt.Errorf("kafka producer: %w", err)
	}
	defer producer.Close()
	kclient, err := sarama.NewClient(brokers, publisher.SaramaConsumerConfig(nil)) // counts the records on the topic
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	defer kclient.Close()
	newSub := func(group string) (*kafka.Subscriber, error) {
		sc, err := publisher.NewKafkaSubscriberConfig(kcfg, group)
		if err != nil {
			return nil, err
		}
		sc.NackResendSleep = 20 * time.Millisecond
		sc.ReconnectRetrySleep = 100 * time.Millisecond
		return kafka.NewSubscriber(sc, logger)
	}

	// --- The payment provider.
	provider, err := NewProvider(cfg.ProviderLatency)
	if err != nil {
		return nil, err
	}
	provider.ignoreKeys = cfg.providerIgnoresKeys
	defer provider.Close()
	progress("payment provider on %s", provider.URL())

	// --- Everything that runs in the background.
	bg, bgCtx := errgroup.WithContext(ctx)
	stopBG, stopAll := context.WithCancel(bgCtx)
	defer func() { // on early returns too: stop and wait for every service
		stopAll()
		_ = bg.Wait()
	}()

	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: pool, Outbox: ob, Producer: producer, PollInterval: 20 * time.Millisecond}, logger)
	if err != nil {
		return nil, err
	}
	bg.Go(func() error { return fwd.Run(stopBG) })

	poisonMW, err := wmw.PoisonQueueWithFilter(kafkaPub, n.poison, idem.IsPermanent)
	if err != nil {
		return nil, err
	}
	billingSvc := NewBillingService(provider.URL())

	newRouter := func() (*message.Router, error) {
		// CloseTimeout is a deadline for a busy machine, not an expected
		// duration: closing waits for in-flight handlers and for Sarama to
		// leave the consumer group.
		return message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, logger)
	}
	billingRouter, err := newRouter()
	if err != nil {
		return nil, err
	}
	billingDedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: n.billing, Table: table, Outbox: ob}, logger)
	if err != nil {
		return nil, err
	}
	billingStats := &groupStats{dedup: billingDedup}
	for i := 1; i <= cfg.BillingInstances; i++ {
		sub, err := newSub(n.billing)
		if err != nil {
			return nil, err
		}
		// The router closes each handler's publisher on shutdown; the handlers
		// share kafkaPub (closed by the defer above), so each gets a view whose
		// Close does nothing: watermill-kafka's Close is not safe to call twice
		// concurrently.
		h := billingRouter.AddHandler("billing-"+strconv.Itoa(i), n.orders, sub, n.charged, sharedPublisher{kafkaPub}, billingSvc.Handle)
		h.AddMiddleware(poisonMW, billingStats.outer, billingDedup.Middleware, inner)
	}
	notifyRouter, err := newRouter()
	if err != nil {
		return nil, err
	}
	notifyDedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: n.notification, Table: table}, logger)
	if err != nil {
		return nil, err
	}
	notifyStats := &groupStats{dedup: notifyDedup}
	notifySub, err := newSub(n.notification)
	if err != nil {
		return nil, err
	}
	h := notifyRouter.AddConsumerHandler("notification", n.orders, notifySub, NotificationService{}.Handle)
	h.AddMiddleware(poisonMW, notifyStats.outer, notifyDedup.Middleware, inner)

	// Audit consumers: what reached the poison topic and billing.charged.
	audit := newAuditor()
	for _, a := range []struct{ group, topic string }{{n.auditPoison, n.poison}, {n.auditCharge, n.charged}} {
		sub, err := newSub(a.group)
		if err != nil {
			return nil, err
		}
		ch, err := sub.Subscribe(stopBG, a.topic)
		if err != nil {
			return nil, fmt.Errorf("subscribe %s: %w", a.topic, err)
		}
		topic := a.topic
		bg.Go(func() error {
			defer sub.Close()
			for msg := range ch {
				audit.record(topic == n.poison, msg)
				msg.Ack()
			}
			return nil
		})
	}

	for _, r := range []*message.Router{billingRouter, notifyRouter} {
		bg.Go(func() error { return r.Run(stopBG) })
	}
	for _, r := range []*message.Router{billingRouter, notifyRouter} {
		select {
		case <-r.Running():
		case <-ctx.Done():
			return nil, fmt.Errorf("routers did not start: %w", ctx.Err())
		}
	}
	progress("billing (%d instances, group %s) and notification (group %s) running", cfg.BillingInstances, n.billing, n.notification)

	rep = &Report{Orders: cfg.Orders}
	status := func(phase string) {
		b, nt, ps := billingStats.report(), notifyStats.report(), provider.Stats()
		progress("%s: outbox forwarded %d · billing %d processed, %d skipped (%d redelivered by Kafka), %d retried · notification %d processed, %d skipped (%d redelivered by Kafka) · provider %d charges, %d replayed · poisoned %d",
			phase, fwd.Stats().Forwarded, b.Processed, b.Skipped, b.KafkaRedelivered, b.Failed, nt.Processed, nt.Skipped, nt.KafkaRedelivered, ps.Charges, ps.Replayed, audit.poisonedTotal())
	}
	// The forwarder reads only rows below the oldest running transaction of
	// the whole server (watermill-sql's visibility rule): say so when that
	// holds it back.
	var lastForwarded uint64
	lastMoved := time.Now()
	stallHint := func() {
		if f := fwd.Stats().Forwarded; f != lastForwarded {
			lastForwarded, lastMoved = f, time.Now()
			return
		}
		if time.Since(lastMoved) < 3*time.Second {
			return
		}
		var age float64
		var pid int
		err := pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - xact_start), pid FROM pg_stat_activity
			WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() ORDER BY xact_start LIMIT 1`).Scan(&age, &pid)
		if err == nil && age > 2 {
			progress("  outbox forwarder waiting: transaction of pid %d has been open %.0fs on this server; outbox rows committed after it started become visible to the forwarder only when it ends", pid, age)
		}
	}
	// waitFor polls cond, printing progress about once a second.
	waitFor := func(phase string, cond func() bool) error {
		last := time.Now()
		for !cond() {
			select {
			case <-ctx.Done():
				status(phase + " (timed out)")
				return fmt.Errorf("%s: %w", phase, ctx.Err())
			case <-bgCtx.Done():
				return fmt.Errorf("%s: a background service failed: %w", phase, context.Cause(bgCtx))
			case <-time.After(20 * time.Millisecond):
			}
			if time.Since(last) >= time.Second {
				status(phase)
				stallHint()
				last = time.Now()
			}
		}
		return nil
	}

	// --- Phase 1: confirm orders; lose some provider responses; publish
	// some events twice.
	orders := make([]Order, cfg.Orders)
	for i := range orders {
		orders[i] = Order{
			ID:          fmt.Sprintf("ord-%05d", i+1),
			CustomerID:  fmt.Sprintf("cus-%03d", i%37+1),
			TotalAmount: fmt.Sprintf("%d.%02d", 10+i%490, i%100),
			Currency:    []string{"EUR", "USD", "GBP"}[i%3],
		}
	}
	for i := 0; i < cfg.LostResponses && i < len(orders); i++ {
		provider.DropResponse(orders[(i*7+3)%len(orders)].ID)
	}
	rep.LostResponses = min(cfg.LostResponses, len(orders))
	svc := &OrderService{DB: pool, Outbox: ob}
	var published, republished atomic.Int64
	progress("phase 1: confirming %d orders (orders row + outbox event in one tx), %d lost provider responses, 1 event in %d published twice",
		len(orders), rep.LostResponses, cfg.RedeliverEvery)
	var eg errgroup.Group
	eg.SetLimit(4)
	for i, o := range orders {
		eg.Go(func() error {
			msg, err := svc.Confirm(ctx, o)
			if err != nil {
				return err
			}
			published.Add(1)
			if cfg.RedeliverEvery > 0 && (i+1)%cfg.RedeliverEvery == 0 {
				if err := kafkaPub.Publish(n.orders, msg.Copy()); err != nil {
					return fmt.Errorf("re-publish: %w", err)
				}
				published.Add(1)
				republished.Add(1)
			}
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		return nil, err
	}
	rep.Republished = int(republished.Load())
	if err := waitFor("phase 1", func() bool {
		return billingDedup.Stats().Processed >= uint64(len(orders)) && notifyDedup.Stats().Processed >= uint64(len(orders))
	}); err != nil {
		return nil, err
	}
	status("phase 1 done")

	// --- Phase 2: new orders whose events are also published on every
	// partition at once: consumers of different partitions claim the same
	// event id concurrently (as after a rebalance or a DLQ replay). The
	// provider is slow for these orders, so the first claim's transaction is
	// still open when the other copies arrive: their INSERT waits on the
	// unique index, then finds the committed row and skips.
	k := cfg.ConcurrentDuplicates
	progress("phase 2: %d more orders, each event also published on all %d partitions at once; 3 malformed events", k, cfg.Partitions)
	extra := make([]Order, k)
	for i := range extra {
		extra[i] = Order{ID: fmt.Sprintf("ord-c%04d", i+1), CustomerID: "cus-c", TotalAmount: fmt.Sprintf("%d.00", 100+i), Currency: "EUR"}
		provider.SlowCharge(extra[i].ID, cfg.ConcurrentLatency)
	}
	var copiesSent atomic.Int64
	eg = errgroup.Group{}
	for _, o := range extra {
		eg.Go(func() error {
			msg, err := svc.Confirm(ctx, o)
			if err != nil {
				return err
			}
			published.Add(1)
			var wg sync.WaitGroup
			errs := make([]error, cfg.Partitions)
			for p := range cfg.Partitions {
				c := msg.Copy()
				c.Metadata.Set("demo_partition", strconv.Itoa(int(p)))
				wg.Add(1)
				go func() { defer wg.Done(); errs[p] = partPub.Publish(n.orders, c) }()
			}
			wg.Wait()
			copiesSent.Add(int64(cfg.Partitions))
			published.Add(int64(cfg.Partitions))
			return errors.Join(errs...)
		})
	}
	if err := eg.Wait(); err != nil {
		return nil, fmt.Errorf("phase 2: %w", err)
	}
	rep.ConcurrentSent = int(copiesSent.Load())
	orders = append(orders, extra...)
	rep.Orders = len(orders)

	bad := malformedEvents()
	if err := kafkaPub.Publish(n.orders, bad...); err != nil {
		return nil, fmt.Errorf("publish malformed: %w", err)
	}
	rep.Malformed = len(bad)
	published.Add(int64(len(bad)))
	rep.Published = int(published.Load())

	// Settled: every record on the topic was delivered to the end (acked or
	// poisoned; failures come again until they end) in both groups, and every
	// billing.charged.v1 reached Kafka. The topic is counted from Kafka's
	// offsets, so a batch the forwarder resent is waited for too.
	if err := waitFor("phase 2", func() bool {
		if billingStats.records() < rep.Published || notifyStats.records() < rep.Published || audit.chargedCount() < len(orders) {
			return false
		}
		onTopic, err := topicRecords(kclient, n.orders)
		if err != nil {
			progress("  counting the records on %s: %v", n.orders, err)
			return false
		}
		rep.OnTopic = onTopic
		return billingStats.records() >= onTopic && notifyStats.records() >= onTopic
	}); err != nil {
		return nil, err
	}
	status("phase 2 done")

	// Stop the consumers; their counts are final once the routers have
	// closed. Closing one billing instance rebalances its partitions to the
	// other, which may receive records again whose offsets were not
	// committed yet: they are counted like any other delivery.
	for _, r := range []*message.Router{billingRouter, notifyRouter} {
		if err := r.Close(); err != nil {
			return nil, fmt.Errorf("close router: %w", err)
		}
	}
	// Every rejection published one poison record: wait until the auditor
	// has read them all, then stop the forwarder and the auditors.
	if err := waitFor("shutdown", func() bool {
		return audit.poisoned("billing") >= int(billingStats.rejected.Load()) &&
			audit.poisoned("notification") >= int(notifyStats.rejected.Load())
	}); err != nil {
		return nil, err
	}
	stopAll()
	_ = fwd.Close()
	if err := bg.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return nil, fmt.Errorf("background: %w", err)
	}

	// --- Collect.
	rep.Billing, rep.Notification = billingStats.report(), notifyStats.report()
	rep.Billing.Poisoned, rep.Notification.Poisoned = audit.poisoned("billing"), audit.poisoned("notification")
	rep.Billing.PoisonedEvents, rep.Notification.PoisonedEvents = audit.poisonedEvents("billing"), audit.poisonedEvents("notification")
	rep.PoisonReasons = audit.reasons()
	rep.Provider = provider.Stats()
	rep.ChargedConsumed = audit.chargedCount()
	rep.Forwarded = fwd.Stats().Forwarded
	bctx := context.WithoutCancel(ctx)
	count := func(q string, args ...any) int {
		var v int
		if err := pool.QueryRow(bctx, q, args...).Scan(&v); err != nil {
			rep.Violations = append(rep.Violations, fmt.Sprintf("query %q: %v", q, err))
		}
		return v
	}
	rep.LedgerRows = count(`SELECT count(*) FROM ledger`)
	rep.Notifications = count(`SELECT count(*) FROM notifications`)
	rep.Billing.Claims = count(`SELECT count(*) FROM processed_event WHERE consumer_group = $1`, n.billing)
	rep.Notification.Claims = count(`SELECT count(*) FROM processed_event WHERE consumer_group = $1`, n.notification)
	rep.ChargedOutbox = count(`SELECT count(*) FROM ` + ob.MessagesTable(n.charged))

	// --- Invariants.
	check := func(ok bool, format string, args ...any) {
		if !ok {
			rep.Violations = append(rep.Violations, fmt.Sprintf(format, args...))
		}
	}
	N := len(orders)
	check(count(`SELECT count(*) FROM orders`) == N, "orders table has %d rows, want %d", count(`SELECT count(*) FROM orders`), N)
	perOrder := provider.ChargesPerOrder()
	check(rep.Provider.Charges == N, "provider charges = %d, want one per order (%d)", rep.Provider.Charges, N)
	for _, o := range orders {
		if c := perOrder[o.ID]; c != 1 {
			check(false, "order %s was charged %d times", o.ID, c)
		}
	}
	check(rep.LedgerRows == N, "ledger rows = %d, want %d", rep.LedgerRows, N)
	check(count(`SELECT count(*) FROM (SELECT order_id FROM ledger GROUP BY order_id HAVING count(*) <> 1) x`) == 0, "some orders have more than one ledger row")
	check(count(`SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM ledger l WHERE l.order_id = o.id)`) == 0, "some orders have no ledger row")
	check(rep.Notifications == N, "notifications = %d, want %d", rep.Notifications, N)
	check(count(`SELECT count(*) FROM (SELECT order_id FROM notifications GROUP BY order_id HAVING count(*) <> 1) x`) == 0, "some orders have more than one notification")
	check(rep.Billing.Claims == N && rep.Notification.Claims == N, "processed_event rows: billing %d, notification %d, want %d each", rep.Billing.Claims, rep.Notification.Claims, N)
	check(rep.ChargedOutbox == N, "billing.charged.v1 outbox rows = %d, want %d", rep.ChargedOutbox, N)
	check(rep.ChargedConsumed == N, "distinct billing.charged.v1 events on Kafka = %d, want %d", rep.ChargedConsumed, N)
	check(rep.OnTopic >= rep.Published, "%d records on %s, but the demo published %d", rep.OnTopic, n.orders, rep.Published)
	rep.Violations = append(rep.Violations, groupViolations(rep, "billing", rep.Billing)...)
	rep.Violations = append(rep.Violations, groupViolations(rep, "notification", rep.Notification)...)
	check(rep.Provider.Dropped == rep.LostResponses, "provider lost %d responses, want %d", rep.Provider.Dropped, rep.LostResponses)
	check(rep.Provider.Replayed >= rep.LostResponses, "provider replayed %d stored responses, want at least %d (one per lost response)", rep.Provider.Replayed, rep.LostResponses)
	check(rep.Provider.Mismatched == 0, "provider saw %d keys reused with a different body", rep.Provider.Mismatched)

	// Outbox tables are not pruned by the forwarder: delete what it has
	// forwarded (docs/operations.md shows the same statement).
	for _, topic := range []string{n.orders, n.charged} {
		total := count(`SELECT count(*) FROM ` + ob.MessagesTable(topic))
		pruned, err := PruneForwarded(bctx, pool, ob, topic, outbox.DefaultForwarderGroup)
		if err != nil {
			rep.Violations = append(rep.Violations, err.Error())
			continue
		}
		rep.OutboxPruned += pruned
		check(pruned == int64(total), "outbox %s: pruned %d of %d forwarded rows", topic, pruned, total)
	}
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// groupViolations checks what one consumer group's handler chain did: each
// event processed once, every delivery accounted for, and duplicates and
// rejections at least what the demo put on the topic (Kafka may deliver a
// record again after a rebalance; the claim absorbs it).
func groupViolations(rep *Report, name string, r GroupReport) []string {
	var v []string
	check := func(ok bool, format string, args ...any) {
		if !ok {
			v = append(v, name+": "+fmt.Sprintf(format, args...))
		}
	}
	check(r.Processed == uint64(rep.Orders), "handler committed %d times, want %d", r.Processed, rep.Orders)
	check(r.Deliveries == r.Added(), "deliveries %d != processed %d + skipped %d + rejected %d + failed %d = %d",
		r.Deliveries, r.Processed, r.Skipped, r.Rejected, r.Failed, r.Added())
	check(r.MiddlewareErrors == uint64(r.Rejected+r.Failed), "the middleware counted %d errors, it returned %d (rejected %d + failed %d)",
		r.MiddlewareErrors, r.Rejected+r.Failed, r.Rejected, r.Failed)
	check(r.NoRecord == 0, "%d deliveries without a Kafka partition and offset", r.NoRecord)
	check(r.Records == rep.OnTopic, "%d of the %d records on the topic were delivered to the end", r.Records, rep.OnTopic)
	check(r.Skipped >= uint64(rep.Injected()+rep.Resent()), "duplicates skipped %d, want at least %d (injected) + %d (sent twice by the forwarder)",
		r.Skipped, rep.Injected(), rep.Resent())
	check(r.Rejected >= int64(rep.Malformed), "rejected %d, want at least %d (malformed)", r.Rejected, rep.Malformed)
	// Whatever was skipped or rejected beyond the copies on the topic is a
	// record Kafka delivered again after its delivery had ended.
	beyond := int64(r.Skipped) - int64(rep.Injected()+rep.Resent()) + r.Rejected - int64(rep.Malformed)
	check(beyond == int64(r.KafkaRedelivered), "skipped and rejected exceed the copies on the topic by %d, but Kafka delivered %d records again",
		beyond, r.KafkaRedelivered)
	check(r.Poisoned == int(r.Rejected), "%d records on the poison topic, want one per rejection (%d)", r.Poisoned, r.Rejected)
	check(r.PoisonedEvents == rep.Malformed, "%d distinct messages poisoned, want the %d malformed", r.PoisonedEvents, rep.Malformed)
	return v
}

// malformedEvents are three messages no redelivery can fix: a bad payload
// with a valid event id (the handler refuses it), no event id at all and a
// non-v7 event id (the middleware refuses both before any transaction).
func malformedEvents() []*message.Message {
	badAmount := publisher.NewEventID()
	m1 := message.NewMessage(badAmount.String(), []byte(fmt.Sprintf(
		`{"eventId":%q,"eventType":"order.confirmed.v1","occurredAt":%q,"aggregateType":"Order","orderId":"ord-bad-1","customerId":"cus-1","totalAmount":"-5.00","currency":"EUR"}`,
		badAmount, time.Now().UTC().Format(time.RFC3339Nano))))
	m1.Metadata.Set(publisher.MetadataEventID, badAmount.String())
	m1.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-1")

	m2 := message.NewMessage(watermill.NewUUID(), []byte("this is not JSON and has no event id"))
	m2.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-2")

	v4 := uuid.New()
	m3 := message.NewMessage(v4.String(), []byte(fmt.Sprintf(
		`{"eventId":%q,"eventType":"order.confirmed.v1","occurredAt":%q,"aggregateType":"Order","orderId":"ord-bad-3","customerId":"cus-1","totalAmount":"5.00","currency":"EUR"}`,
		v4, time.Now().UTC().Format(time.RFC3339Nano))))
	m3.Metadata.Set(publisher.MetadataEventID, v4.String())
	m3.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-3")
	return []*message.Message{m1, m2, m3}
}

// auditor records what reached the poison and billing.charged topics.
type auditor struct {
	mu          sync.Mutex
	poison      map[string]map[record]bool // "billing" or "notification" (from handler_poisoned) -> records
	poisonIDs   map[string]map[string]bool // same -> distinct message UUIDs
	reasonSeen  map[string]bool
	reasonsList []string
	charged     map[string]bool // distinct event ids
}

func newAuditor() *auditor {
	return &auditor{
		poison: map[string]map[record]bool{"billing": {}, "notification": {}}, poisonIDs: map[string]map[string]bool{"billing": {}, "notification": {}},
		reasonSeen: map[string]bool{}, charged: map[string]bool{},
	}
}

// record notes a message read from the poison topic (poison) or
// billing.charged. Poison records are counted by (partition, offset), so a
// record the auditor's own group reads twice counts once.
func (a *auditor) record(poison bool, msg *message.Message) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !poison {
		a.charged[msg.Metadata.Get(publisher.MetadataEventID)] = true
		return
	}
	service := "notification"
	if strings.HasPrefix(msg.Metadata.Get(wmw.PoisonedHandlerKey), "billing") {
		service = "billing"
	}
	p, _ := kafka.MessagePartitionFromCtx(msg.Context())
	o, _ := kafka.MessagePartitionOffsetFromCtx(msg.Context())
	a.poison[service][record{p, o}] = true
	a.poisonIDs[service][msg.UUID] = true
	reason := msg.Metadata.Get(wmw.ReasonForPoisonedKey)
	if !a.reasonSeen[reason] {
		a.reasonSeen[reason] = true
		a.reasonsList = append(a.reasonsList, reason)
	}
}

// poisoned counts the poison records of "billing" or "notification".
func (a *auditor) poisoned(service string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poison[service])
}

// poisonedEvents counts the distinct messages among them.
func (a *auditor) poisonedEvents(service string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poisonIDs[service])
}

func (a *auditor) poisonedTotal() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poison["billing"]) + len(a.poison["notification"])
}

func (a *auditor) chargedCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.charged)
}

func (a *auditor) reasons() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.reasonsList...)
}

// topicRecords returns the number of records on topic: the sum over its
// partitions of the newest minus the oldest offset.
func topicRecords(client sarama.Client, topic string) (int, error) {
	if err := client.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	n := int64(0)
	for _, p := range parts {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return 0, err
		}
		n += newest - oldest
	}
	return int(n), nil
}

func openSchema(ctx context.Context, url, schema string) (*pgxpool.Pool, error) {
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL at %s: %w (set DATABASE_URL)", url, err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create schema: %w", err)
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.MaxConns = 12 // a winner never needs a second connection, so waiting claims cannot starve it
	return pgxpool.NewWithConfig(ctx, pcfg)
}

func dropSchema(url, schema string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("drop schema: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", schema, err)
	}
	return nil
}

// PruneForwarded deletes the rows of topic's outbox table that the forwarder
// group has already sent: those at or before its position (transaction id,
// offset). Rows of transactions still in flight are never below it.
func PruneForwarded(ctx context.Context, db *pgxpool.Pool, ob *outbox.Outbox, topic, forwarderGroup string) (int64, error) {
	tag, err := db.Exec(ctx, `DELETE FROM `+ob.MessagesTable(topic)+` m
		USING `+ob.OffsetsTable(topic)+` o
		WHERE o.consumer_group = $1
		  AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)`, forwarderGroup)
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", topic, err)
	}
	return tag.RowsAffected(), nil
}

// sharedPublisher lends a publisher to a router handler without letting the
// router close it.
type sharedPublisher struct{ message.Publisher }

func (sharedPublisher) Close() error { return nil }
