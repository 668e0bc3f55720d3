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
	// Timeout bounds the whole run.
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
		c.Timeout = 3 * time.Minute // normally ~5 s; generous for a shared server (see the "forwarder waiting" hint)
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// GroupReport is what one consumer group's handlers did.
type GroupReport struct {
	Deliveries int64 // messages that reached the dedup middleware, redeliveries included
	Processed  int64 // handler ran and the transaction committed
	Skipped    int64 // duplicates: claim found a committed row, handler not run
	// InFlightSkipped are the skipped duplicates that arrived while the
	// processing copy was still in flight (its transaction open).
	InFlightSkipped int
	Failed          int64 // transient errors: rolled back, nacked, redelivered
	Rejected        int64 // permanent errors: sent to the poison topic
	Claims          int   // processed_event rows of the group
	Poisoned        int   // messages of the group seen on the poison topic
}

// Report is the outcome of a run.
type Report struct {
	Orders          int
	Published       int // copies put on orders.confirmed: originals + injected
	Redelivered     int
	ConcurrentSent  int
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

// groupStats counts outcomes around the dedup middleware.
type groupStats struct {
	deliveries, processed, skipped, failed, rejected atomic.Int64

	mu         sync.Mutex
	committed  map[string]time.Time   // event id -> when its processing delivery returned
	skipStarts map[string][]time.Time // event id -> when its skipped deliveries started
}

type ranKey struct{}

// outer wraps the dedup middleware and classifies each delivery's outcome.
func (s *groupStats) outer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		s.deliveries.Add(1)
		begin := time.Now()
		ran := new(atomic.Bool)
		ctx := msg.Context()
		msg.SetContext(context.WithValue(ctx, ranKey{}, ran))
		defer msg.SetContext(ctx)
		out, err := h(msg)
		switch {
		case err != nil && idem.IsPermanent(err):
			s.rejected.Add(1)
		case err != nil:
			s.failed.Add(1)
		case ran.Load():
			s.processed.Add(1)
			s.track(msg, begin, false)
		default:
			s.skipped.Add(1)
			s.track(msg, begin, true)
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

func (s *groupStats) track(msg *message.Message, begin time.Time, skipped bool) {
	id := msg.Metadata.Get(publisher.MetadataEventID)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.committed == nil {
		s.committed, s.skipStarts = map[string]time.Time{}, map[string][]time.Time{}
	}
	if skipped {
		s.skipStarts[id] = append(s.skipStarts[id], begin)
	} else {
		s.committed[id] = time.Now()
	}
}

// overlapping counts skipped duplicates that started while the copy that
// was processed had not returned yet: they met it in flight.
func (s *groupStats) overlapping() int {
	s.mu.Lock()
	defer s.mu.Unlock()
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
	return GroupReport{InFlightSkipped: s.overlapping(), Deliveries: s.deliveries.Load(), Processed: s.processed.Load(), Skipped: s.skipped.Load(), Failed: s.failed.Load(), Rejected: s.rejected.Load()}
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
	var billingStats, notifyStats groupStats
	billingSvc := NewBillingService(provider.URL())

	newRouter := func() (*message.Router, error) {
		return message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	}
	billingRouter, err := newRouter()
	if err != nil {
		return nil, err
	}
	billingDedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: n.billing, Table: table, Outbox: ob}, logger)
	if err != nil {
		return nil, err
	}
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
		progress("%s: outbox forwarded %d · billing %d processed, %d skipped, %d retried · notification %d processed, %d skipped · provider %d charges, %d replayed · poisoned %d",
			phase, fwd.Stats().Forwarded, b.Processed, b.Skipped, b.Failed, nt.Processed, nt.Skipped, ps.Charges, ps.Replayed, audit.poisonedTotal())
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
	confirmed := make([]*message.Message, len(orders))
	var published, redelivered atomic.Int64
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
			confirmed[i] = msg
			published.Add(1)
			if cfg.RedeliverEvery > 0 && (i+1)%cfg.RedeliverEvery == 0 {
				if err := kafkaPub.Publish(n.orders, msg.Copy()); err != nil {
					return fmt.Errorf("re-publish: %w", err)
				}
				published.Add(1)
				redelivered.Add(1)
			}
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		return nil, err
	}
	rep.Redelivered = int(redelivered.Load())
	if err := waitFor("phase 1", func() bool {
		return billingStats.processed.Load() >= int64(len(orders)) && notifyStats.processed.Load() >= int64(len(orders))
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

	// Every copy ends as processed, skipped or rejected (failures are
	// redelivered until they end as one of those).
	settled := func(s *groupStats) bool {
		return s.processed.Load()+s.skipped.Load()+s.rejected.Load() >= int64(rep.Published)
	}
	if err := waitFor("phase 2", func() bool {
		return settled(&billingStats) && settled(&notifyStats) &&
			audit.poisoned("billing") >= rep.Malformed && audit.poisoned("notification") >= rep.Malformed &&
			audit.chargedCount() >= len(orders)
	}); err != nil {
		return nil, err
	}
	status("phase 2 done")

	// A short grace period so a late extra delivery would be counted.
	time.Sleep(300 * time.Millisecond)
	stopAll()
	for _, r := range []*message.Router{billingRouter, notifyRouter} {
		_ = r.Close()
	}
	_ = fwd.Close()
	if err := bg.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return nil, fmt.Errorf("background: %w", err)
	}

	// --- Collect.
	rep.Billing, rep.Notification = billingStats.report(), notifyStats.report()
	rep.Billing.Poisoned, rep.Notification.Poisoned = audit.poisoned("billing"), audit.poisoned("notification")
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
	check(rep.Billing.Processed == int64(N) && rep.Notification.Processed == int64(N), "handlers committed billing %d, notification %d times, want %d each", rep.Billing.Processed, rep.Notification.Processed, N)
	check(rep.ChargedOutbox == N, "billing.charged.v1 outbox rows = %d, want %d", rep.ChargedOutbox, N)
	check(rep.ChargedConsumed == N, "distinct billing.charged.v1 events on Kafka = %d, want %d", rep.ChargedConsumed, N)
	check(rep.Billing.Poisoned == rep.Malformed && rep.Notification.Poisoned == rep.Malformed, "poisoned: billing %d, notification %d, want %d each", rep.Billing.Poisoned, rep.Notification.Poisoned, rep.Malformed)
	check(rep.Billing.Rejected == int64(rep.Malformed) && rep.Notification.Rejected == int64(rep.Malformed), "rejected: billing %d, notification %d, want %d each", rep.Billing.Rejected, rep.Notification.Rejected, rep.Malformed)
	wantSkipped := int64(rep.Published - rep.Malformed - N)
	check(rep.Billing.Skipped == wantSkipped && rep.Notification.Skipped == wantSkipped, "duplicates skipped: billing %d, notification %d, want %d each", rep.Billing.Skipped, rep.Notification.Skipped, wantSkipped)
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
	poison      map[string]int // "billing" or "notification", from handler_poisoned
	reasonSeen  map[string]bool
	reasonsList []string
	charged     map[string]bool // distinct event ids
}

func newAuditor() *auditor {
	return &auditor{poison: map[string]int{}, reasonSeen: map[string]bool{}, charged: map[string]bool{}}
}

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
	a.poison[service]++
	reason := msg.Metadata.Get(wmw.ReasonForPoisonedKey)
	if !a.reasonSeen[reason] {
		a.reasonSeen[reason] = true
		a.reasonsList = append(a.reasonsList, reason)
	}
}

// poisoned counts the poisoned messages of "billing" or "notification".
func (a *auditor) poisoned(service string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.poison[service]
}

func (a *auditor) poisonedTotal() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.poison["billing"] + a.poison["notification"]
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
