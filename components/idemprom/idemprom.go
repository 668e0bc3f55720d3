package idemprom

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/statsx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

var (
	group = []string{"consumer_group"}
	fwd   = []string{"forwarder"}

	descProcessed   = prometheus.NewDesc("idem_dedup_processed_total", "Messages whose handler ran and whose transaction committed.", group, nil)
	descDuplicates  = prometheus.NewDesc("idem_dedup_duplicates_total", "Messages acked without running the handler: already processed by this consumer group.", group, nil)
	descFailed      = prometheus.NewDesc("idem_dedup_failed_total", "First-time messages rolled back: handler error or panic, outbox or COMMIT failure.", group, nil)
	descClaimErrors = prometheus.NewDesc("idem_dedup_claim_errors_total", "Messages whose BEGIN or claim failed.", group, nil)
	descKafkaAhead  = prometheus.NewDesc("idem_dedup_kafka_ahead_total", "Records watermill-kafka's subscriber skipped past the group's position in PostgreSQL (after a failover or a restore: run idemctl groups progress GROUP --rewind).", group, nil)
	descRejected    = prometheus.NewDesc("idem_dedup_rejected_total", "Messages refused before any SQL (poison queue), by reason.", []string{"consumer_group", "reason"}, nil)
	descClaimSec    = prometheus.NewDesc("idem_dedup_claim_seconds_total", "Time spent in BEGIN + claim, including waits on a concurrent claim of the same event.", group, nil)
	descClaims      = prometheus.NewDesc("idem_dedup_claims_total", "Claims timed in idem_dedup_claim_seconds_total.", group, nil)
	descTxSec       = prometheus.NewDesc("idem_dedup_tx_seconds_total", "Time from BEGIN to COMMIT of processed messages.", group, nil)

	descGroups         = prometheus.NewDesc("idem_dedup_groups_total", "Group-commit transactions that claimed their messages (Config.Mode = &GroupCommitConfig{}).", group, nil)
	descGroupedMsgs    = prometheus.NewDesc("idem_dedup_grouped_messages_total", "Messages claimed in group-commit transactions (divided by idem_dedup_groups_total: the mean group size).", group, nil)
	descGroupFallbacks = prometheus.NewDesc("idem_dedup_group_fallbacks_total", "Groups rolled back by a handler error or panic, their messages then processed alone.", group, nil)
	descLeases         = prometheus.NewDesc("idem_dedup_leases_total", "Lease mode (Config.Mode = &LeaseConfig{}), by event: taken (new or taken over), taken_over (from an expired lease), renewed, lost (taken over or released before completion: nothing written), busy (gave up on another delivery's live lease), fast_path (of the taken: completed in their take's transaction, no lease row).", []string{"consumer_group", "event"}, nil)
	descAlone          = prometheus.NewDesc("idem_dedup_alone_total", "Messages processed in a transaction of their own in group-commit mode: after a group fallback, a failed group claim, or an earlier failure of their handler.", group, nil)

	descForwarded   = prometheus.NewDesc("idem_outbox_forwarded_total", "Outbox rows sent to Kafka and acknowledged in the database.", fwd, nil)
	descCommits     = prometheus.NewDesc("idem_outbox_forwarder_commits_total", "Committed forwarder position updates.", fwd, nil)
	descPolls       = prometheus.NewDesc("idem_outbox_forwarder_polls_total", "Reads of the outbox by the forwarder.", fwd, nil)
	descFwdErrors   = prometheus.NewDesc("idem_outbox_forwarder_errors_total", "Failed forwarder batches (rolled back and retried).", fwd, nil)
	descQuarantined = prometheus.NewDesc("idem_outbox_forwarder_quarantined_total", "Outbox rows moved to a dead table: rows that cannot be sent, and the later rows of their keys.", fwd, nil)

	descRetried   = prometheus.NewDesc("idem_retry_retried_total", "Copies published to a retry topic after a transient failure (retrytopic.Stats.Retried).", group, nil)
	descRecovered = prometheus.NewDesc("idem_retry_recovered_total", "Retry-topic copies that then succeeded.", group, nil)
	descPoisoned  = prometheus.NewDesc("idem_retry_poisoned_total", "Messages the retry-topic middleware published to the poison topic.", group, nil)
	descFollowed  = prometheus.NewDesc("idem_retry_followed_total", "KeyOrder: events parked behind an earlier event of their key.", group, nil)
	descReleased  = prometheus.NewDesc("idem_retry_released_total", "KeyOrder: parked events released (applied or poisoned).", group, nil)
	descHandedOff = prometheus.NewDesc("idem_retry_handed_off_total", "KeyOrder: releases that handed their key to the next parked event.", group, nil)
	descOverdue   = prometheus.NewDesc("idem_retry_overdue_keys", "KeyOrder: parked keys whose first event's copy was overdue by more than KeyOrder.OverdueAfter at the middleware's last check (retrytopic.Stats.OverdueKeys): a stalled retry path.", group, nil)

	descParkedKeys    = prometheus.NewDesc("idem_retry_parked_keys", "KeyOrder: keys with parked events.", group, nil)
	descParkedEvents  = prometheus.NewDesc("idem_retry_parked_events", "KeyOrder: parked events (each key's first and those waiting behind it).", group, nil)
	descParkedQueue   = prometheus.NewDesc("idem_retry_parked_max_queue", "KeyOrder: the longest queue of a key.", group, nil)
	descParkedOldest  = prometheus.NewDesc("idem_retry_parked_oldest_seconds", "KeyOrder: age of the oldest parked event.", group, nil)
	descParkedOverdue = prometheus.NewDesc("idem_retry_parked_head_overdue_seconds", "KeyOrder: longest time a key's first event's copy has been due without coming back.", group, nil)

	part = []string{"consumer_group", "topic", "partition"}

	descKafkaInFlight    = prometheus.NewDesc("idem_kafka_in_flight", "parallel.Subscriber: messages handed out and not yet acked or nacked (at most MaxInFlight).", group, nil)
	descKafkaWaiting     = prometheus.NewDesc("idem_kafka_keys_waiting", "parallel.Subscriber: records waiting for an earlier message of their key (OrderPartition: of their partition).", group, nil)
	descKafkaHeld        = prometheus.NewDesc("idem_kafka_held", "parallel.Subscriber: records waiting for their NotBeforeFunc time (retry topics).", group, nil)
	descKafkaSpilled     = prometheus.NewDesc("idem_kafka_spilled", "parallel.Subscriber: of the records waiting behind their key, those whose payload left a full window: read again from Kafka when they become their key's head (at most 64 × PartitionWindow per partition).", group, nil)
	descKafkaAcked       = prometheus.NewDesc("idem_kafka_acked_total", "parallel.Subscriber: messages acked.", group, nil)
	descKafkaNacked      = prometheus.NewDesc("idem_kafka_nacked_total", "parallel.Subscriber: messages nacked (handed out again after NackResendSleep).", group, nil)
	descKafkaRefetched   = prometheus.NewDesc("idem_kafka_refetched_total", "parallel.Subscriber: spilled records read again from Kafka when they became their key's head (each was read twice).", group, nil)
	descKafkaSkipped     = prometheus.NewDesc("idem_kafka_skipped_total", "parallel.Subscriber: records not handed out because the commit metadata recorded them done before a restart or rebalance.", group, nil)
	descKafkaSessions    = prometheus.NewDesc("idem_kafka_sessions_total", "parallel.Subscriber: consumer-group sessions set up (the first join, then one per rebalance).", group, nil)
	descKafkaRefused     = prometheus.NewDesc("idem_kafka_commits_refused_total", "parallel.Subscriber: offset commits the broker refused (OffsetMetadataTooLarge, InvalidCommitOffsetSize): the committed offset does not move while they are refused.", group, nil)
	descKafkaDistance    = prometheus.NewDesc("idem_kafka_partition_distance", "parallel.Subscriber: per held partition, the highest offset handed out + 1 - the committed offset (0 when nothing handed out is pending): how far processing runs ahead of the commit, which bounds what a crash makes run again.", part, nil)
	descKafkaWindow      = prometheus.NewDesc("idem_kafka_partition_window", "parallel.Subscriber: per held partition, the records held from the committed offset on (at most PartitionWindow).", part, nil)
	descKafkaStalled     = prometheus.NewDesc("idem_kafka_stalled_keys", "parallel.Subscriber: keys whose head record has waited StallTimeout or longer without an ack (failing, slow or queued; Stats().Stalls and the log name the key and the cause).", group, nil)
	descKafkaPartStalled = prometheus.NewDesc("idem_kafka_partition_stalled_seconds", "parallel.Subscriber: per held partition, how long it has gone without an ack while one of its keys is stalled (0 when none is, or for less than StallTimeout).", part, nil)
	descKafkaMaxInFlight = prometheus.NewDesc("idem_kafka_max_in_flight", "parallel.Subscriber: MaxInFlight (the bound of idem_kafka_in_flight).", group, nil)

	tbl = []string{"table"}

	descTableRows       = prometheus.NewDesc("idem_dedup_table_rows_estimate", "AddTable: the dedup table's rows as the planner estimates them (pg_class.reltuples of the table and its partitions), never a count(*).", tbl, nil)
	descTableBytes      = prometheus.NewDesc("idem_dedup_table_bytes", "AddTable: the dedup table's size on disk, partitions, indexes and TOAST included.", tbl, nil)
	descTableRetention  = prometheus.NewDesc("idem_dedup_retention_seconds", "AddTable: the retention recorded with the dedup table.", tbl, nil)
	descTableCleaned    = prometheus.NewDesc("idem_dedup_last_clean_timestamp_seconds", "AddTable: when the Cleaner's last pass ran (Unix time; 0: never), from the cutoff it recorded.", tbl, nil)
	descTablePartitions = prometheus.NewDesc("idem_dedup_partitions", "AddTable: the dedup table's partitions (0 for the plain layout).", tbl, nil)

	descPending = prometheus.NewDesc("idem_outbox_pending_rows", "Committed outbox rows the forwarder has not forwarded yet.", []string{"topic", "forwarder"}, nil)
	descOldest  = prometheus.NewDesc("idem_outbox_oldest_pending_seconds", "Age of the oldest outbox row not forwarded yet (0 when none).", []string{"topic", "forwarder"}, nil)
	descDead    = prometheus.NewDesc("idem_outbox_dead_rows", "Rows in the topic's dead table (idemctl outbox dead list): rows that cannot be sent and the rows held behind them.", []string{"topic", "forwarder"}, nil)
)

type parkedSource struct {
	db    migrate.DBTX
	table retrytopic.ParkedKeysTable
	group string
}

type tableSource struct {
	db  migrate.DBTX
	cfg deduplicator.TableConfig
}

type retrySource struct {
	group string
	rt    *retrytopic.RetryTopic
}

type backlogSource struct {
	ob   *outbox.Outbox
	db   migrate.Beginner
	opts outbox.BacklogOpts
}

// Collector is a prometheus.Collector over dedup middlewares and outbox
// forwarders. It reads their counters at scrape time; it is safe for
// concurrent use.
type Collector struct {
	mu sync.Mutex
	sources
	reads dbReads
}

// sources are the components a Collector reads.
type sources struct {
	dedups     []*idem.Dedup
	forwarders map[string]*outbox.Forwarder
	backlogs   []backlogSource
	retries    []retrySource
	parked     []parkedSource
	tables     []tableSource
	subs       []*parallel.Subscriber
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns an empty Collector; add components, then register it.
func NewCollector() *Collector {
	return &Collector{sources: sources{forwarders: map[string]*outbox.Forwarder{}}}
}

// AddDedup exports d's counters, labelled with its consumer group. Adding two
// middlewares of the same group sums them.
func (c *Collector) AddDedup(d *idem.Dedup) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dedups = append(c.dedups, d)
}

// AddForwarder exports f's counters with the label forwarder=name: pass
// its ForwarderConfig.Name (outbox.DefaultForwarderName by default), the
// value of the backlog gauges' forwarder label. A second forwarder with the
// same name replaces the first.
func (c *Collector) AddForwarder(name string, f *outbox.Forwarder) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.forwarders[name] = f
}

// AddOutboxBacklog exports the outbox lag that [outbox.Outbox.Backlog]
// reports for opts (nil: ob's topics, the forwarder named
// outbox.DefaultForwarderName), with the labels topic and forwarder (the
// forwarder's Name), queried from db at each scrape (bounded by
// 5 s with the other database readings of the scrape; a failed query
// fails the scrape's metric rather than reporting a stale value).
func (c *Collector) AddOutboxBacklog(ob *outbox.Outbox, db migrate.Beginner, opts *outbox.BacklogOpts) {
	c.mu.Lock()
	defer c.mu.Unlock()
	o := cloneOpts(opts)
	c.backlogs = append(c.backlogs, backlogSource{ob: ob, db: db, opts: o})
}

// AddRetryTopic exports rt's counters (retrytopic.Stats) with the label
// consumer_group=group (its dedup consumer group). Adding two of the same
// group sums them.
func (c *Collector) AddRetryTopic(group string, rt *retrytopic.RetryTopic) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.retries = append(c.retries, retrySource{group: group, rt: rt})
}

// AddParked exports the parked keys of retrytopic.KeyOrder in table (of
// group only, unless ""): their number, events, longest queue, the age of
// the oldest and how long a first event's copy is overdue
// (as idemctl retry parked sums them up), queried from db at each scrape
// (bounded by 5 s with the other database readings of the scrape).
func (c *Collector) AddParked(db migrate.DBTX, table retrytopic.ParkedKeysTable, group string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.parked = append(c.parked, parkedSource{db: db, table: table, group: group})
}

// AddTable exports the dedup table named by cfg, read from the catalog
// and the table's recorded setting at each scrape (bounded by 5 s with the
// other database readings of the scrape; no row of the table is read): its estimated rows, its size, its
// retention, its partitions and when the Cleaner last ran, with the label
// table=schema.table. Alert on the last clean: a Cleaner that stopped lets
// the table grow.
func (c *Collector) AddTable(db migrate.DBTX, cfg deduplicator.TableConfig) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tables = append(c.tables, tableSource{db: db, cfg: cfg})
}

// AddSubscriber exports the Stats of idemkafka's parallel subscriber with
// the label consumer_group (its Kafka consumer group): messages in flight,
// keys waiting (and of them spilled), held, acked, nacked, skipped, sessions, refused commits
// and stalled keys, and per held partition (labels topic, partition) the
// distance between the committed offset and the highest one handed out,
// the window, and how long it has been stalled. Adding two
// subscribers of the same group sums them.
func (c *Collector) AddSubscriber(sub *parallel.Subscriber) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.subs = append(c.subs, sub)
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descProcessed, descDuplicates, descFailed, descClaimErrors, descKafkaAhead, descRejected, descClaimSec, descClaims, descTxSec,
		descGroups, descGroupedMsgs, descGroupFallbacks, descAlone, descLeases, descForwarded, descCommits, descPolls, descFwdErrors, descQuarantined, descPending, descOldest, descDead,
		descRetried, descRecovered, descPoisoned, descFollowed, descReleased, descHandedOff, descOverdue,
		descParkedKeys, descParkedEvents, descParkedQueue, descParkedOldest, descParkedOverdue,
		descTableRows, descTableBytes, descTableRetention, descTableCleaned, descTablePartitions,
		descKafkaInFlight, descKafkaWaiting, descKafkaHeld, descKafkaSpilled, descKafkaRefetched, descKafkaAcked, descKafkaNacked, descKafkaSkipped, descKafkaSessions, descKafkaRefused,
		descKafkaDistance, descKafkaWindow, descKafkaMaxInFlight, descKafkaStalled, descKafkaPartStalled} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.snapshot()
	e := emitter(ch)
	e.dedups(s.dedups)
	e.forwarders(s.forwarders)
	e.retries(s.retries)
	e.subscribers(s.subs)
	c.reads.collect(e, s.dbReadings())
}

// snapshot copies the sources under the lock: a scrape reads them without it.
func (c *Collector) snapshot() sources {
	c.mu.Lock()
	defer c.mu.Unlock()
	forwarders := make(map[string]*outbox.Forwarder, len(c.forwarders))
	for k, v := range c.forwarders {
		forwarders[k] = v
	}
	return sources{
		dedups:     append([]*idem.Dedup(nil), c.dedups...),
		forwarders: forwarders,
		backlogs:   append([]backlogSource(nil), c.backlogs...),
		retries:    append([]retrySource(nil), c.retries...),
		parked:     append([]parkedSource(nil), c.parked...),
		tables:     append([]tableSource(nil), c.tables...),
		subs:       append([]*parallel.Subscriber(nil), c.subs...),
	}
}

// emitter sends one scrape's metrics.
type emitter chan<- prometheus.Metric

func (e emitter) counter(d *prometheus.Desc, v float64, labels ...string) {
	e <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
}

func (e emitter) gauge(d *prometheus.Desc, v float64, labels ...string) {
	e <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

// dedups emits the dedup middlewares' counters, summed per consumer group.
func (e emitter) dedups(dedups []*idem.Dedup) {
	for _, gs := range statsx.ByKey(dedups, (*idem.Dedup).ConsumerGroup, (*idem.Dedup).Stats, idem.Stats.Add) {
		g, s := gs.Key, gs.Value
		e.counter(descProcessed, float64(s.Processed), g)
		e.counter(descDuplicates, float64(s.Duplicates), g)
		e.counter(descFailed, float64(s.Failed), g)
		e.counter(descClaimErrors, float64(s.ClaimErrors), g)
		e.counter(descKafkaAhead, float64(s.KafkaAhead), g)
		for reason, n := range s.Rejected.ByReason() {
			e.counter(descRejected, float64(n), g, reason)
		}
		e.counter(descClaimSec, s.ClaimDuration.Seconds(), g)
		e.counter(descClaims, float64(s.ClaimCount), g)
		e.counter(descTxSec, s.TxDuration.Seconds(), g)
		e.counter(descGroups, float64(s.Groups), g)
		e.counter(descGroupedMsgs, float64(s.GroupedMessages), g)
		e.counter(descGroupFallbacks, float64(s.GroupFallbacks), g)
		e.counter(descAlone, float64(s.Alone), g)
		e.counter(descLeases, float64(s.LeasesTaken), g, "taken")
		e.counter(descLeases, float64(s.LeasesTakenOver), g, "taken_over")
		e.counter(descLeases, float64(s.LeasesRenewed), g, "renewed")
		e.counter(descLeases, float64(s.LeasesLost), g, "lost")
		e.counter(descLeases, float64(s.LeasesBusy), g, "busy")
		e.counter(descLeases, float64(s.LeasesFastPath), g, "fast_path")
	}
}

// forwarders emits each outbox forwarder's counters.
func (e emitter) forwarders(forwarders map[string]*outbox.Forwarder) {
	for name, f := range forwarders {
		s := f.Stats()
		e.counter(descForwarded, float64(s.Forwarded), name)
		e.counter(descCommits, float64(s.Commits), name)
		e.counter(descPolls, float64(s.Polls), name)
		e.counter(descFwdErrors, float64(s.Errors), name)
		e.counter(descQuarantined, float64(s.Quarantined), name)
	}
}

// retries emits the retry topics' counters, summed per consumer group.
func (e emitter) retries(retries []retrySource) {
	for _, gs := range statsx.ByKey(retries, func(r retrySource) string { return r.group }, func(r retrySource) retrytopic.Stats { return r.rt.Stats() }, addRetryStats) {
		g, s := gs.Key, gs.Value
		e.counter(descRetried, float64(s.Retried), g)
		e.counter(descRecovered, float64(s.Recovered), g)
		e.counter(descPoisoned, float64(s.Poisoned), g)
		e.counter(descFollowed, float64(s.Followed), g)
		e.counter(descReleased, float64(s.Released), g)
		e.counter(descHandedOff, float64(s.HandedOff), g)
		e.gauge(descOverdue, float64(s.OverdueKeys), g)
	}
}

// subscribers emits the Kafka subscribers' state, summed per consumer group,
// and each partition's.
func (e emitter) subscribers(subs []*parallel.Subscriber) {
	for _, gs := range statsx.ByKey(subs, (*parallel.Subscriber).ConsumerGroup, (*parallel.Subscriber).Stats, parallel.SubscriberStats.Add) {
		g, s := gs.Key, gs.Value
		e.gauge(descKafkaInFlight, float64(s.InFlight), g)
		e.gauge(descKafkaWaiting, float64(s.KeysWaiting), g)
		e.gauge(descKafkaHeld, float64(s.Held), g)
		e.gauge(descKafkaSpilled, float64(s.Spilled), g)
		e.gauge(descKafkaMaxInFlight, float64(s.MaxInFlight), g)
		e.counter(descKafkaAcked, float64(s.Acked), g)
		e.counter(descKafkaNacked, float64(s.Nacked), g)
		e.counter(descKafkaSkipped, float64(s.Skipped), g)
		e.counter(descKafkaRefetched, float64(s.Refetched), g)
		e.counter(descKafkaSessions, float64(s.Sessions), g)
		e.counter(descKafkaRefused, float64(s.CommitsRefused), g)
		e.gauge(descKafkaStalled, float64(s.StalledKeys), g)
		for _, p := range s.Partitions {
			id := strconv.Itoa(int(p.Partition))
			e.gauge(descKafkaDistance, float64(p.Distance), g, p.Topic, id)
			e.gauge(descKafkaWindow, float64(p.Window), g, p.Topic, id)
			e.gauge(descKafkaPartStalled, p.StalledFor.Seconds(), g, p.Topic, id)
		}
	}
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

// addRetryStats sums the retry-topic counters the collector exports.
func addRetryStats(a, b retrytopic.Stats) retrytopic.Stats {
	a.Retried += b.Retried
	a.Recovered += b.Recovered
	a.Poisoned += b.Poisoned
	a.Followed += b.Followed
	a.Released += b.Released
	a.HandedOff += b.HandedOff
	a.OverdueKeys = max(a.OverdueKeys, b.OverdueKeys) // a reading of one table: every instance sees the same keys
	return a
}
