package idemotel

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/statsx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// backlogTimeout bounds the backlog query of one collection.
const backlogTimeout = 5 * time.Second

type backlogSource struct {
	ob   *outbox.Outbox
	db   migrate.Beginner
	opts outbox.BacklogOpts
}

// Metrics holds the observable instruments and the components they read.
// Add components at any time; it is safe for concurrent use.
type Metrics struct {
	reg metric.Registration

	mu         sync.Mutex
	dedups     []*idem.Dedup
	forwarders map[string]*outbox.Forwarder
	fwdOrder   []string
	backlogs   []backlogSource
	subs       []*parallel.Subscriber

	processed, duplicates, failed, claimErrors, rejected, claims metric.Int64ObservableCounter
	groups, grouped, groupFallbacks, alone                       metric.Int64ObservableCounter
	leases                                                       metric.Int64ObservableCounter
	claimTime, txTime                                            metric.Float64ObservableCounter
	forwarded, commits, polls, fwdErrors, quarantined            metric.Int64ObservableCounter
	pending                                                      metric.Int64ObservableGauge
	oldest                                                       metric.Float64ObservableGauge
	kInFlight, kWaiting, kHeld, kMaxInFlight, kDistance, kWindow metric.Int64ObservableGauge
	kAcked, kNacked, kSkipped, kRefetched, kSessions, kRefused   metric.Int64ObservableCounter
	kStalled, kSpilled                                           metric.Int64ObservableGauge
	kPartStalled                                                 metric.Float64ObservableGauge
}

// New creates the instruments on the meter [otelx.Meter] of mp (nil: the
// global provider, otel.GetMeterProvider(), which forwards to the SDK once
// one is installed) and registers the callback that observes them. Call
// [Metrics.Close] to unregister it.
func New(mp metric.MeterProvider) (*Metrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(otelx.Meter)
	m := &Metrics{forwarders: map[string]*outbox.Forwarder{}}
	var errs []error
	counter := func(name, unit, desc string) metric.Int64ObservableCounter {
		c, err := meter.Int64ObservableCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	seconds := func(name, desc string) metric.Float64ObservableCounter {
		c, err := meter.Float64ObservableCounter(name, metric.WithUnit("s"), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	m.processed = counter("idem.dedup.processed", "{message}", "Messages whose handler ran and whose transaction committed.")
	m.duplicates = counter("idem.dedup.duplicates", "{message}", "Messages acked without running the handler: already processed by this consumer group.")
	m.failed = counter("idem.dedup.failed", "{message}", "First-time messages rolled back: handler error or panic, outbox or COMMIT failure.")
	m.claimErrors = counter("idem.dedup.claim_errors", "{message}", "Messages whose BEGIN or claim failed.")
	m.rejected = counter("idem.dedup.rejected", "{message}", "Messages refused before any SQL (poison queue), by reason.")
	m.claims = counter("idem.dedup.claims", "{claim}", "Claims timed in idem.dedup.claim.time.")
	m.claimTime = seconds("idem.dedup.claim.time", "Time spent in BEGIN + claim, including waits on a concurrent claim of the same event.")
	m.txTime = seconds("idem.dedup.tx.time", "Time from BEGIN to COMMIT of processed messages.")
	m.groups = counter("idem.dedup.group.commits", "{transaction}", "Group-commit transactions claimed (idem.dedup.group.messages messages).")
	m.grouped = counter("idem.dedup.group.messages", "{message}", "Messages claimed in group-commit transactions.")
	m.groupFallbacks = counter("idem.dedup.group.fallbacks", "{transaction}", "Groups rolled back by a handler failure, their messages processed alone.")
	m.leases = counter("idem.dedup.leases", "{lease}", "Lease mode (Config.Mode = &LeaseConfig{}), by idem.lease.event: taken, taken_over, renewed, lost (nothing written), busy (gave up on another delivery's live lease).")
	m.alone = counter("idem.dedup.alone", "{message}", "Messages processed in their own transaction in group-commit mode (after a fallback, a failed group claim or an earlier failure of their handler).")
	m.forwarded = counter("idem.outbox.forwarded", "{message}", "Outbox rows sent to Kafka and acknowledged in the database.")
	m.commits = counter("idem.outbox.forwarder.commits", "{commit}", "Committed forwarder position updates.")
	m.polls = counter("idem.outbox.forwarder.polls", "{poll}", "Reads of the outbox by the forwarder.")
	m.fwdErrors = counter("idem.outbox.forwarder.errors", "{batch}", "Failed forwarder batches (rolled back and retried).")
	m.quarantined = counter("idem.outbox.forwarder.quarantined", "{row}", "Outbox rows moved to a dead table: rows that cannot be sent, and the later rows of their keys.")
	gauge := func(name, unit, desc string) metric.Int64ObservableGauge {
		g, err := meter.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	m.kInFlight = gauge("idem.kafka.in_flight", "{message}", "parallel.Subscriber: messages handed out and not yet acked or nacked (at most MaxInFlight).")
	m.kWaiting = gauge("idem.kafka.keys_waiting", "{message}", "parallel.Subscriber: records waiting for an earlier message of their key (OrderPartition: of their partition).")
	m.kHeld = gauge("idem.kafka.held", "{message}", "parallel.Subscriber: records waiting for their NotBeforeFunc time (retry topics).")
	m.kSpilled = gauge("idem.kafka.spilled", "{message}", "parallel.Subscriber: of the records waiting behind their key, those whose payload left a full window: read again from Kafka when they become their key's head (at most 64 × PartitionWindow per partition).")
	m.kMaxInFlight = gauge("idem.kafka.max_in_flight", "{message}", "parallel.Subscriber: MaxInFlight (the bound of idem.kafka.in_flight).")
	m.kDistance = gauge("idem.kafka.partition.distance", "{message}", "parallel.Subscriber: per held partition, the highest offset handed out + 1 - the committed offset (0 when nothing handed out is pending).")
	m.kWindow = gauge("idem.kafka.partition.window", "{message}", "parallel.Subscriber: per held partition, the records held from the committed offset on (at most PartitionWindow).")
	m.kAcked = counter("idem.kafka.acked", "{message}", "parallel.Subscriber: messages acked.")
	m.kNacked = counter("idem.kafka.nacked", "{message}", "parallel.Subscriber: messages nacked (handed out again after NackResendSleep).")
	m.kRefetched = counter("idem.kafka.refetched", "{message}", "parallel.Subscriber: spilled records read again from Kafka when they became their key's head (each was read twice).")
	m.kSkipped = counter("idem.kafka.skipped", "{message}", "parallel.Subscriber: records not handed out because the commit metadata recorded them done before a restart or rebalance.")
	m.kSessions = counter("idem.kafka.sessions", "{session}", "parallel.Subscriber: consumer-group sessions set up (the first join, then one per rebalance).")
	m.kRefused = counter("idem.kafka.commits_refused", "{commit}", "parallel.Subscriber: offset commits the broker refused (OffsetMetadataTooLarge, InvalidCommitOffsetSize): the committed offset does not move while they are refused.")
	m.kStalled = gauge("idem.kafka.stalled_keys", "{key}", "parallel.Subscriber: keys whose head record has waited StallTimeout or longer without an ack (failing, slow or queued; Stats().Stalls and the log name the key and the cause).")
	var err error
	m.kPartStalled, err = meter.Float64ObservableGauge("idem.kafka.partition.stalled", metric.WithUnit("s"),
		metric.WithDescription("parallel.Subscriber: per held partition, how long it has gone without an ack while one of its keys is stalled (0 when none is, or for less than StallTimeout)."))
	errs = append(errs, err)
	m.pending, err = meter.Int64ObservableGauge("idem.outbox.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Committed outbox rows the forwarder has not forwarded yet."))
	errs = append(errs, err)
	m.oldest, err = meter.Float64ObservableGauge("idem.outbox.oldest_pending_age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest outbox row not forwarded yet (0 when none)."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("idemotel: create instruments: %w", err)
	}
	m.reg, err = meter.RegisterCallback(m.observe,
		m.processed, m.duplicates, m.failed, m.claimErrors, m.rejected, m.claims, m.claimTime, m.txTime,
		m.groups, m.grouped, m.groupFallbacks, m.alone, m.leases,
		m.forwarded, m.commits, m.polls, m.fwdErrors, m.quarantined, m.pending, m.oldest,
		m.kInFlight, m.kWaiting, m.kHeld, m.kSpilled, m.kMaxInFlight, m.kDistance, m.kWindow, m.kAcked, m.kNacked, m.kSkipped, m.kRefetched, m.kSessions, m.kRefused, m.kStalled, m.kPartStalled)
	if err != nil {
		return nil, fmt.Errorf("idemotel: register callback: %w", err)
	}
	return m, nil
}

// Close unregisters the callback: the instruments report nothing more.
func (m *Metrics) Close() error { return m.reg.Unregister() }

// AddDedup reports d's counters with the attribute
// messaging.consumer.group.name. Adding two middlewares of the same group
// sums them.
func (m *Metrics) AddDedup(d *idem.Dedup) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dedups = append(m.dedups, d)
}

// AddForwarder reports f's counters with the attribute idem.outbox.forwarder.name
// = name: pass its ForwarderConfig.Name (outbox.DefaultForwarderName by
// default), the value of the backlog gauges' attribute. A second forwarder
// with the same name replaces the first.
func (m *Metrics) AddForwarder(name string, f *outbox.Forwarder) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.forwarders[name]; !ok {
		m.fwdOrder = append(m.fwdOrder, name)
	}
	m.forwarders[name] = f
}

// AddOutboxBacklog reports the outbox lag that [outbox.Outbox.Backlog]
// gives for opts (nil: ob's topics, the forwarder named
// outbox.DefaultForwarderName) as the gauges idem.outbox.pending and
// idem.outbox.oldest_pending_age, with the attributes
// messaging.destination.name (the topic) and idem.outbox.forwarder.name, queried
// from db at each collection (bounded by 5 s).
func (m *Metrics) AddOutboxBacklog(ob *outbox.Outbox, db migrate.Beginner, opts *outbox.BacklogOpts) {
	m.mu.Lock()
	defer m.mu.Unlock()
	o := cloneOpts(opts)
	m.backlogs = append(m.backlogs, backlogSource{ob: ob, db: db, opts: o})
}

// AddSubscriber reports the Stats of idemkafka's parallel subscriber with
// the attribute messaging.consumer.group.name (its Kafka consumer group):
// idem.kafka.in_flight, keys_waiting, spilled, held, max_in_flight, acked, nacked,
// skipped, sessions, commits_refused and stalled_keys, and per held
// partition (attributes messaging.destination.name and
// messaging.destination.partition.id) idem.kafka.partition.distance
// (between the committed offset and the highest one handed out),
// idem.kafka.partition.window and idem.kafka.partition.stalled. Adding two
// subscribers of the same group sums them.
func (m *Metrics) AddSubscriber(sub *parallel.Subscriber) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.subs = append(m.subs, sub)
}

// observe is the callback of every instrument.
func (m *Metrics) observe(ctx context.Context, o metric.Observer) error {
	m.mu.Lock()
	dedups := append([]*idem.Dedup(nil), m.dedups...)
	forwarders := make([]*outbox.Forwarder, len(m.fwdOrder))
	for i, name := range m.fwdOrder {
		forwarders[i] = m.forwarders[name]
	}
	names := append([]string(nil), m.fwdOrder...)
	backlogs := append([]backlogSource(nil), m.backlogs...)
	subs := append([]*parallel.Subscriber(nil), m.subs...)
	m.mu.Unlock()

	m.observeSubscribers(o, subs)
	m.observeDedups(o, dedups)
	m.observeForwarders(o, forwarders, names)
	return m.observeBacklogs(ctx, o, backlogs)
}

// observeSubscribers observes the Kafka subscribers' state, summed per
// consumer group, and each partition's.
func (m *Metrics) observeSubscribers(o metric.Observer, subs []*parallel.Subscriber) {
	for _, gs := range statsx.ByKey(subs, (*parallel.Subscriber).ConsumerGroup, (*parallel.Subscriber).Stats, parallel.SubscriberStats.Add) {
		group := semconv.MessagingConsumerGroupName(gs.Key)
		set := metric.WithAttributeSet(attribute.NewSet(group))
		s := gs.Value
		o.ObserveInt64(m.kInFlight, int64(s.InFlight), set)
		o.ObserveInt64(m.kWaiting, int64(s.KeysWaiting), set)
		o.ObserveInt64(m.kHeld, int64(s.Held), set)
		o.ObserveInt64(m.kSpilled, int64(s.Spilled), set)
		o.ObserveInt64(m.kMaxInFlight, int64(s.MaxInFlight), set)
		o.ObserveInt64(m.kAcked, int64(s.Acked), set)
		o.ObserveInt64(m.kNacked, int64(s.Nacked), set)
		o.ObserveInt64(m.kSkipped, int64(s.Skipped), set)
		o.ObserveInt64(m.kRefetched, int64(s.Refetched), set)
		o.ObserveInt64(m.kSessions, int64(s.Sessions), set)
		o.ObserveInt64(m.kRefused, int64(s.CommitsRefused), set)
		o.ObserveInt64(m.kStalled, int64(s.StalledKeys), set)
		for _, p := range s.Partitions {
			pset := metric.WithAttributeSet(attribute.NewSet(group, semconv.MessagingDestinationName(p.Topic),
				semconv.MessagingDestinationPartitionID(strconv.Itoa(int(p.Partition)))))
			o.ObserveInt64(m.kDistance, p.Distance, pset)
			o.ObserveInt64(m.kWindow, int64(p.Window), pset)
			o.ObserveFloat64(m.kPartStalled, p.StalledFor.Seconds(), pset)
		}
	}
}

// observeDedups observes the dedup middlewares' counters, summed per
// consumer group.
func (m *Metrics) observeDedups(o metric.Observer, dedups []*idem.Dedup) {
	for _, gs := range statsx.ByKey(dedups, (*idem.Dedup).ConsumerGroup, (*idem.Dedup).Stats, idem.Stats.Add) {
		g, s := gs.Key, gs.Value
		group := semconv.MessagingConsumerGroupName(g)
		set := metric.WithAttributeSet(attribute.NewSet(group))
		o.ObserveInt64(m.processed, int64(s.Processed), set)
		o.ObserveInt64(m.duplicates, int64(s.Duplicates), set)
		o.ObserveInt64(m.failed, int64(s.Failed), set)
		o.ObserveInt64(m.claimErrors, int64(s.ClaimErrors), set)
		for reason, n := range s.Rejected.ByReason() {
			o.ObserveInt64(m.rejected, int64(n), metric.WithAttributeSet(attribute.NewSet(group, otelx.AttrRejectReason.String(reason))))
		}
		o.ObserveInt64(m.claims, int64(s.ClaimCount), set)
		o.ObserveFloat64(m.claimTime, s.ClaimDuration.Seconds(), set)
		o.ObserveFloat64(m.txTime, s.TxDuration.Seconds(), set)
		o.ObserveInt64(m.groups, int64(s.Groups), set)
		o.ObserveInt64(m.grouped, int64(s.GroupedMessages), set)
		o.ObserveInt64(m.groupFallbacks, int64(s.GroupFallbacks), set)
		o.ObserveInt64(m.alone, int64(s.Alone), set)
		for ev, n := range map[string]uint64{"taken": s.LeasesTaken, "taken_over": s.LeasesTakenOver, "renewed": s.LeasesRenewed, "lost": s.LeasesLost, "busy": s.LeasesBusy, "fast_path": s.LeasesFastPath} {
			o.ObserveInt64(m.leases, int64(n), metric.WithAttributeSet(attribute.NewSet(group, attribute.String("idem.lease.event", ev))))
		}
	}
}

// observeForwarders observes each outbox forwarder's counters; names[i]
// names forwarders[i].
func (m *Metrics) observeForwarders(o metric.Observer, forwarders []*outbox.Forwarder, names []string) {
	for i, f := range forwarders {
		s := f.Stats()
		set := metric.WithAttributeSet(attribute.NewSet(otelx.AttrForwarder.String(names[i])))
		o.ObserveInt64(m.forwarded, int64(s.Forwarded), set)
		o.ObserveInt64(m.commits, int64(s.Commits), set)
		o.ObserveInt64(m.polls, int64(s.Polls), set)
		o.ObserveInt64(m.fwdErrors, int64(s.Errors), set)
		o.ObserveInt64(m.quarantined, int64(s.Quarantined), set)
	}
}

// observeBacklogs observes each outbox's backlog per topic and forwarder,
// read now; it returns the reads that failed.
func (m *Metrics) observeBacklogs(ctx context.Context, o metric.Observer, backlogs []backlogSource) error {
	var errs []error
	for _, b := range backlogs {
		qctx, cancel := context.WithTimeout(ctx, backlogTimeout)
		rows, err := b.ob.Backlog(qctx, b.db, &b.opts)
		cancel()
		if err != nil {
			// No value rather than a stale one; the SDK hands the error to
			// its error handler (a ManualReader returns it from Collect).
			errs = append(errs, fmt.Errorf("idemotel: outbox backlog: %w", err))
			continue
		}
		for _, r := range rows {
			set := metric.WithAttributeSet(attribute.NewSet(semconv.MessagingDestinationName(r.Topic), otelx.AttrForwarder.String(r.Forwarder)))
			o.ObserveInt64(m.pending, r.Pending, set)
			o.ObserveFloat64(m.oldest, r.OldestAge.Seconds(), set)
		}
	}
	return errors.Join(errs...)
}

// cloneOpts copies opts (nil: the zero value), so that the caller may
// change its own afterwards.
func cloneOpts(opts *outbox.BacklogOpts) outbox.BacklogOpts {
	if opts == nil {
		return outbox.BacklogOpts{}
	}
	o := *opts
	o.Topics = append([]string(nil), opts.Topics...)
	return o
}
