package idemprom_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestCollectorExportsDedupAndForwarder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 6)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	b := kafkatest.Start(t)
	topic := b.Topic(t, "prom", 1)

	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{topic}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), topic)))

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

	producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: b.Addrs})
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
idem_dedup_rejected_total{consumer_group="billing",reason="event_id_mismatch"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="invalid_event_id"} 1
idem_dedup_rejected_total{consumer_group="billing",reason="missing_event_id"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="nil_event_id"} 0
idem_dedup_rejected_total{consumer_group="billing",reason="not_uuidv7"} 0
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
	require.Equal(t, 32, n) // 24 dedup series (6 rejected reasons, 4 group-commit, 6 lease events) + 5 forwarder + 3 backlog series
}

func TestCollectorExportsGroupCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 6)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))

	// Concurrent deliveries in group mode, one of whose handlers fails once
	// (its group rolls back; its messages then go alone). How the groups
	// form depends on timing; the export must equal the middleware's Stats.
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table,
		Mode: &idem.GroupCommitConfig{MaxWait: time.Minute, Concurrency: 2}}, nil)
	require.NoError(t, err)
	var failOnce sync.Map // event ids whose handler fails on its first run
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, first := failOnce.LoadAndDelete(msg.Metadata.Get(publisher.MetadataEventID)); first {
			return nil, errors.New("transient")
		}
		return nil, nil
	})
	var wg sync.WaitGroup
	for i := range 12 {
		id := publisher.NewEventID().String()
		if i == 5 {
			failOnce.Store(id, true)
		}
		wg.Go(func() {
			m := message.NewMessage(watermill.NewUUID(), nil)
			m.Metadata.Set(publisher.MetadataEventID, id)
			_, err := h(m)
			assert.NoError(t, err) // a failed group's messages succeed alone
		})
	}
	wg.Wait()
	st := d.Stats()
	require.EqualValues(t, 12, st.Processed)
	require.Positive(t, st.Groups)
	require.EqualValues(t, 1, st.GroupFallbacks)
	require.Positive(t, st.Alone)

	c := idemprom.NewCollector()
	c.AddDedup(d)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	expected := fmt.Sprintf(`
# HELP idem_dedup_alone_total Messages processed in a transaction of their own in group-commit mode: after a group fallback, a failed group claim, or an earlier failure of their handler.
# TYPE idem_dedup_alone_total counter
idem_dedup_alone_total{consumer_group="billing"} %d
# HELP idem_dedup_group_fallbacks_total Groups rolled back by a handler error or panic, their messages then processed alone.
# TYPE idem_dedup_group_fallbacks_total counter
idem_dedup_group_fallbacks_total{consumer_group="billing"} 1
# HELP idem_dedup_grouped_messages_total Messages claimed in group-commit transactions (divided by idem_dedup_groups_total: the mean group size).
# TYPE idem_dedup_grouped_messages_total counter
idem_dedup_grouped_messages_total{consumer_group="billing"} %d
# HELP idem_dedup_groups_total Group-commit transactions that claimed their messages (Config.Mode = &GroupCommitConfig{}).
# TYPE idem_dedup_groups_total counter
idem_dedup_groups_total{consumer_group="billing"} %d
# HELP idem_dedup_processed_total Messages whose handler ran and whose transaction committed.
# TYPE idem_dedup_processed_total counter
idem_dedup_processed_total{consumer_group="billing"} 12
`, st.Alone, st.GroupedMessages, st.Groups)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected),
		"idem_dedup_groups_total", "idem_dedup_grouped_messages_total", "idem_dedup_group_fallbacks_total", "idem_dedup_alone_total", "idem_dedup_processed_total"))
}
