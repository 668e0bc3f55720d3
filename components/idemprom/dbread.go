package idemprom

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
)

// dbScrapeTimeout bounds all the database readings of one scrape together
// (the backlogs, the parked keys, the tables): a scrape never waits longer,
// however many sources were added.
const dbScrapeTimeout = 5 * time.Second

// dbReading is one source read from the database at scrape time: read
// queries once and returns the source's metrics; a failure becomes one
// invalid metric of desc.
type dbReading struct {
	desc *prometheus.Desc
	read func(ctx context.Context) ([]prometheus.Metric, error)
}

// dbReads reads the database sources of a Collector: one query per source
// per scrape at most, all of a scrape's under one deadline, and scrapes that
// come while a read is in flight share its result instead of querying again
// (two Prometheus servers scraping at once cost one read).
type dbReads struct {
	mu       sync.Mutex
	inflight *dbCall
	timeout  time.Duration // 0: dbScrapeTimeout (tests set it)
	waiters  int           // scrapes sharing a read in flight, for the tests
}

// dbCall is one read of every database source, shared by the scrapes that
// wait for it.
type dbCall struct {
	done    chan struct{}
	metrics []prometheus.Metric
}

// collect sends the metrics of readings, read now or by the read in flight.
func (r *dbReads) collect(e emitter, readings []dbReading) {
	if len(readings) == 0 {
		return
	}
	r.mu.Lock()
	if call := r.inflight; call != nil {
		r.waiters++
		r.mu.Unlock()
		<-call.done // the read is bounded by its deadline
		r.emit(e, call)
		return
	}
	call := &dbCall{done: make(chan struct{})}
	r.inflight = call
	timeout := orDefault(r.timeout, dbScrapeTimeout)
	r.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	for _, rd := range readings {
		ms, err := rd.read(ctx)
		if err != nil {
			ms = []prometheus.Metric{prometheus.NewInvalidMetric(rd.desc, err)}
		}
		call.metrics = append(call.metrics, ms...)
	}
	cancel()
	r.mu.Lock()
	r.inflight = nil
	r.mu.Unlock()
	close(call.done)
	r.emit(e, call)
}

func (r *dbReads) emit(e emitter, call *dbCall) {
	for _, m := range call.metrics {
		e <- m
	}
}

// orDefault returns d, or def when d is 0.
func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// gauges collects constant gauges for a dbReading.
type gauges []prometheus.Metric

func (g *gauges) add(d *prometheus.Desc, v float64, labels ...string) {
	*g = append(*g, prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...))
}

// dbReadings lists the database sources of s, in the order they were added
// by kind: outbox backlogs, parked keys, dedup tables.
func (s sources) dbReadings() []dbReading {
	var out []dbReading
	for _, b := range s.backlogs {
		out = append(out, dbReading{desc: descPending, read: b.read})
	}
	for _, p := range s.parked {
		out = append(out, dbReading{desc: descParkedKeys, read: p.read})
	}
	for _, t := range s.tables {
		out = append(out, dbReading{desc: descTableBytes, read: t.read})
	}
	return out
}

// read returns the outbox's backlog per topic and forwarder.
func (b backlogSource) read(ctx context.Context) ([]prometheus.Metric, error) {
	rows, err := b.ob.Backlog(ctx, b.db, &b.opts)
	if err != nil {
		return nil, err
	}
	var g gauges
	for _, r := range rows {
		g.add(descPending, float64(r.Pending), r.Topic, r.Forwarder)
		g.add(descOldest, r.OldestAge.Seconds(), r.Topic, r.Forwarder)
		g.add(descDead, float64(r.Dead), r.Topic, r.Forwarder)
	}
	return g, nil
}

// read returns the parked table's summary per consumer group.
func (p parkedSource) read(ctx context.Context) ([]prometheus.Metric, error) {
	sum, err := parkedsql.Summarize(ctx, p.db, p.table.Schema, p.table.Table, p.group, deduplicator.ValidateGroupName)
	if err != nil {
		return nil, err
	}
	if len(sum) == 0 && p.group != "" {
		sum = []parkedsql.Summary{{ConsumerGroup: p.group}}
	}
	var g gauges
	for _, s := range sum {
		g.add(descParkedKeys, float64(s.Keys), s.ConsumerGroup)
		g.add(descParkedEvents, float64(s.Events), s.ConsumerGroup)
		g.add(descParkedQueue, float64(s.MaxQueue), s.ConsumerGroup)
		g.add(descParkedOldest, s.OldestAge.Seconds(), s.ConsumerGroup)
		g.add(descParkedOverdue, s.MaxHeadOverdue.Seconds(), s.ConsumerGroup)
	}
	return g, nil
}

// read returns the dedup table's size, retention and cleaning, from the
// catalog after checking its names.
func (t tableSource) read(ctx context.Context) ([]prometheus.Metric, error) {
	if err := t.cfg.Validate(); err != nil {
		return nil, err
	}
	info, err := dedupsql.Inspect(ctx, t.db, t.cfg.Schema, t.cfg.Table)
	if err != nil {
		return nil, err
	}
	name := info.Schema + "." + info.Table
	last := 0.0
	if !info.CleanedBefore.IsZero() {
		last = float64(info.CleanedBefore.Add(info.Retention).UnixNano()) / 1e9
	}
	var g gauges
	g.add(descTableRows, float64(info.RowsEstimate), name)
	g.add(descTableBytes, float64(info.Bytes), name)
	g.add(descTableRetention, info.Retention.Seconds(), name)
	g.add(descTableCleaned, last, name)
	g.add(descTablePartitions, float64(len(info.Partitions)), name)
	return g, nil
}
