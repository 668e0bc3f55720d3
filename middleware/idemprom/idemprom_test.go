package idemprom_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemprom"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestCollectorExportsDedupAndForwarder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 6)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, deduplicator.Migrate(ctx, db.Pool, table))
	b := kafkatest.Start(t)
	topic := b.Topic(t, "prom", 1)

	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{topic}}, nil)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx, db.Pool))

	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table, Outbox: ob}, nil)
	require.NoError(t, err)
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		p, err := ob.PublisherFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		return nil, p.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	})
	id := publisher.NewEventID().String()
	for _, v := range []string{id, id, "nope"} {
		m := message.NewMessage(watermill.NewUUID(), nil)
		m.Metadata.Set(publisher.MetadataEventID, v)
		_, _ = h(m)
	}

	producer, err := outbox.NewKafkaProducer(publisher.KafkaConfig{Brokers: b.Addrs})
	require.NoError(t, err)
	t.Cleanup(func() { _ = producer.Close() })
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Producer: producer, PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = fwd.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	c := idemprom.NewCollector()
	c.AddDedup(d)
	c.AddForwarder(outbox.DefaultForwarderName, fwd)
	c.AddOutboxBacklog(ob, db.Pool, nil)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))

	require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 1 }, 60*time.Second, 20*time.Millisecond)
	expected := `
# HELP idem_dedup_duplicates_total Messages acked without running the handler: already processed by this consumer group.
# TYPE idem_dedup_duplicates_total counter
idem_dedup_duplicates_total{consumer_group="billing"} 1
# HELP idem_dedup_processed_total Messages whose handler ran and whose transaction committed.
# TYPE idem_dedup_processed_total counter
idem_dedup_processed_total{consumer_group="billing"} 1
# HELP idem_dedup_rejected_total Messages refused before any SQL (poison queue), by reason.
# TYPE idem_dedup_rejected_total counter
idem_dedup_rejected_total{consumer_group="billing",reason="invalid"} 1
idem_dedup_rejected_total{consumer_group="billing",reason="missing"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="nil"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="not_v7"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="stale"} 0
# HELP idem_outbox_pending_rows Committed outbox rows the forwarder has not forwarded yet.
# TYPE idem_outbox_pending_rows gauge
idem_outbox_pending_rows{forwarder="outbox_forwarder",topic="TOPIC"} 0
# HELP idem_outbox_forwarded_total Outbox rows sent to Kafka and acknowledged in the database.
# TYPE idem_outbox_forwarded_total counter
idem_outbox_forwarded_total{forwarder="outbox_forwarder"} 1
`
	expected = strings.ReplaceAll(expected, "TOPIC", topic)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected),
		"idem_dedup_duplicates_total", "idem_dedup_processed_total", "idem_dedup_rejected_total", "idem_outbox_forwarded_total", "idem_outbox_pending_rows"))
	n, err := testutil.GatherAndCount(reg)
	require.NoError(t, err)
	require.Equal(t, 18, n) // 12 dedup series (5 rejected reasons) + 4 forwarder + 2 backlog series
}
