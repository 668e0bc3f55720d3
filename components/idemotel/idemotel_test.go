package idemotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/watermill-idempotency/components/idemotel"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// collected is one collection of a ManualReader, by instrument name.
type collected map[string]metricdata.Metrics

func collect(t *testing.T, r *sdkmetric.ManualReader) (collected, error) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	err := r.Collect(context.Background(), &rm)
	out := collected{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, otelx.Meter, sm.Scope.Name)
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out, err
}

// value returns the data point of metric name whose attributes are exactly
// attrs, as a float64, and whether there is one.
func (c collected) value(t *testing.T, name string, attrs ...attribute.KeyValue) (float64, bool) {
	t.Helper()
	m, ok := c[name]
	if !ok {
		return 0, false
	}
	want := attribute.NewSet(attrs...)
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		require.True(t, d.IsMonotonic, "%s is a counter", name)
		require.Equal(t, metricdata.CumulativeTemporality, d.Temporality)
		for _, p := range d.DataPoints {
			if p.Attributes.Equals(&want) {
				return float64(p.Value), true
			}
		}
	case metricdata.Sum[float64]:
		require.True(t, d.IsMonotonic, "%s is a counter", name)
		for _, p := range d.DataPoints {
			if p.Attributes.Equals(&want) {
				return p.Value, true
			}
		}
	case metricdata.Gauge[int64]:
		for _, p := range d.DataPoints {
			if p.Attributes.Equals(&want) {
				return float64(p.Value), true
			}
		}
	case metricdata.Gauge[float64]:
		for _, p := range d.DataPoints {
			if p.Attributes.Equals(&want) {
				return p.Value, true
			}
		}
	default:
		t.Fatalf("%s: unexpected data %T", name, m.Data)
	}
	return 0, false
}

func (c collected) must(t *testing.T, name string, attrs ...attribute.KeyValue) float64 {
	t.Helper()
	v, ok := c.value(t, name, attrs...)
	require.True(t, ok, "a data point of %s with %v", name, attrs)
	return v
}

var group = attribute.String("messaging.consumer.group.name", "billing")

func reason(r string) attribute.KeyValue { return attribute.String("idem.reject_reason", r) }

// The dedup middleware's and the forwarder's counters and the outbox
// backlog, read by a ManualReader: the same numbers as Stats() and
// Backlog(), under the documented names, units and attributes. A refused
// message's reason is the value its span records.
func TestMetricsExportDedupForwarderAndBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 6)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	b := kafkatest.Start(t)
	topic := b.Topic(t, "otelmetrics", 1)

	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{topic}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), topic)))

	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table, Outbox: ob, TracerProvider: tp}, nil)
	require.NoError(t, err)
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		p, err := ob.PublisherFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		return nil, p.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	})
	id := publisher.NewEventID().String()
	for _, v := range []string{id, id, "nope", uuid.NewString(), ""} { // processed, duplicate, invalid, not v7, missing
		m := message.NewMessage(watermill.NewUUID(), nil)
		if v != "" {
			m.Metadata.Set(publisher.MetadataEventID, v)
		}
		_, _ = h(m)
	}
	failing := d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("down") })
	m := message.NewMessage(watermill.NewUUID(), nil)
	m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
	_, err = failing(m)
	require.Error(t, err)

	// A second middleware of another group, in group-commit mode.
	gd, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "audit", Table: table,
		Mode: &idem.GroupCommitConfig{MaxMessages: 4, MaxWait: time.Millisecond, Concurrency: 1}}, nil)
	require.NoError(t, err)
	gh := gd.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	for range 2 {
		m := message.NewMessage(watermill.NewUUID(), nil)
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		_, err := gh(m)
		require.NoError(t, err)
	}

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	metrics, err := idemotel.New(mp)
	require.NoError(t, err)
	metrics.AddDedup(d)
	metrics.AddDedup(gd)
	metrics.AddOutboxBacklog(ob, db.Pool, nil)

	// Before the forwarder runs: one row pending.
	got, err := collect(t, reader)
	require.NoError(t, err)
	fwdAttrs := []attribute.KeyValue{attribute.String("messaging.destination.name", topic), attribute.String("idem.outbox.forwarder.name", outbox.DefaultForwarderName)}
	require.EqualValues(t, 1, got.must(t, "idem.outbox.pending", fwdAttrs...))
	require.Positive(t, got.must(t, "idem.outbox.oldest_pending_age", fwdAttrs...))

	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: b.Addrs})
	require.NoError(t, err)
	t.Cleanup(func() { _ = producer.Close() })
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Producer: producer, PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = fwd.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	metrics.AddForwarder(outbox.DefaultForwarderName, fwd)
	require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 1 }, 60*time.Second, 20*time.Millisecond)

	fs := fwd.Stats() // before collecting: the counters only grow
	got, err = collect(t, reader)
	require.NoError(t, err)
	s := d.Stats()
	require.EqualValues(t, 1, got.must(t, "idem.dedup.processed", group))
	require.EqualValues(t, 1, got.must(t, "idem.dedup.duplicates", group))
	require.EqualValues(t, 1, got.must(t, "idem.dedup.failed", group))
	require.EqualValues(t, 0, got.must(t, "idem.dedup.claim_errors", group))
	require.EqualValues(t, s.ClaimCount, got.must(t, "idem.dedup.claims", group))
	require.InDelta(t, s.ClaimDuration.Seconds(), got.must(t, "idem.dedup.claim.time", group), 1e-9)
	require.InDelta(t, s.TxDuration.Seconds(), got.must(t, "idem.dedup.tx.time", group), 1e-9)
	require.Positive(t, got.must(t, "idem.dedup.tx.time", group))
	for r, want := range map[string]float64{
		"invalid_event_id": 1, "not_uuidv7": 1, "missing_event_id": 1,
		"nil_event_id": 0, "event_id_mismatch": 0, "stale": 0,
	} {
		require.Equal(t, want, got.must(t, "idem.dedup.rejected", group, reason(r)), r)
	}
	require.EqualValues(t, 0, got.must(t, "idem.dedup.group.commits", group))

	audit := attribute.String("messaging.consumer.group.name", "audit")
	require.EqualValues(t, 2, got.must(t, "idem.dedup.processed", audit))
	require.EqualValues(t, 2, got.must(t, "idem.dedup.group.commits", audit), "each message alone in its group (sequential)")
	require.EqualValues(t, 2, got.must(t, "idem.dedup.group.messages", audit))
	require.EqualValues(t, 0, got.must(t, "idem.dedup.group.fallbacks", audit))
	require.EqualValues(t, 0, got.must(t, "idem.dedup.alone", audit))

	fwdName := attribute.String("idem.outbox.forwarder.name", outbox.DefaultForwarderName)
	require.EqualValues(t, 1, got.must(t, "idem.outbox.forwarded", fwdName))
	require.GreaterOrEqual(t, got.must(t, "idem.outbox.forwarder.commits", fwdName), 1.0)
	require.GreaterOrEqual(t, got.must(t, "idem.outbox.forwarder.polls", fwdName), float64(fs.Polls))
	require.EqualValues(t, 0, got.must(t, "idem.outbox.forwarder.errors", fwdName))
	require.EqualValues(t, 0, got.must(t, "idem.outbox.pending", fwdAttrs...))
	require.EqualValues(t, 0, got.must(t, "idem.outbox.oldest_pending_age", fwdAttrs...))

	// Units and kinds, as documented.
	for name, unit := range map[string]string{
		"idem.dedup.processed": "{message}", "idem.dedup.claim.time": "s", "idem.dedup.tx.time": "s",
		"idem.dedup.claims": "{claim}", "idem.outbox.pending": "{message}", "idem.outbox.oldest_pending_age": "s",
		"idem.dedup.group.commits": "{transaction}",
	} {
		require.Equal(t, unit, got[name].Unit, name)
	}
	require.Len(t, got, 20, "every instrument reported")

	// The reasons are the ones the dedup span records.
	reasons := map[string]bool{}
	for _, sp := range exp.GetSpans() {
		for _, kv := range sp.Attributes {
			if kv.Key == otelx.AttrRejectReason {
				reasons[kv.Value.AsString()] = true
			}
		}
	}
	require.Equal(t, map[string]bool{"invalid_event_id": true, "not_uuidv7": true, "missing_event_id": true}, reasons)

	// Closed: nothing more is reported.
	require.NoError(t, metrics.Close())
	got, err = collect(t, reader)
	require.NoError(t, err)
	require.Empty(t, got)
}

// Two middlewares of one consumer group are summed into one series.
func TestMetricsSumOneGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	metrics, err := idemotel.New(mp)
	require.NoError(t, err)
	t.Cleanup(func() { _ = metrics.Close() })
	for range 2 {
		d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
		require.NoError(t, err)
		m := message.NewMessage(watermill.NewUUID(), nil)
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		_, err = d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(m)
		require.NoError(t, err)
		metrics.AddDedup(d)
	}
	got, err := collect(t, reader)
	require.NoError(t, err)
	require.EqualValues(t, 2, got.must(t, "idem.dedup.processed", group))
	require.Len(t, got["idem.dedup.processed"].Data.(metricdata.Sum[int64]).DataPoints, 1)
}

// A failed backlog query reports no backlog value (never a stale one) and
// returns the error from the collection; the counters are still reported.
func TestMetricsBacklogErrorReportsNoValue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"never_migrated"}}, nil)
	require.NoError(t, err)
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	metrics, err := idemotel.New(mp)
	require.NoError(t, err)
	t.Cleanup(func() { _ = metrics.Close() })
	metrics.AddDedup(d)
	metrics.AddOutboxBacklog(ob, db.Pool, nil)

	got, err := collect(t, reader)
	require.ErrorContains(t, err, "outbox backlog")
	_, ok := got.value(t, "idem.outbox.pending", attribute.String("messaging.destination.name", "never_migrated"), attribute.String("idem.outbox.forwarder.name", outbox.DefaultForwarderName))
	require.False(t, ok, "no backlog value")
	require.EqualValues(t, 0, got.must(t, "idem.dedup.processed", group))
}
