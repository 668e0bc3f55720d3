package idemprom_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// The parallel subscriber's stats: one message of key a in flight (not
// acked), the two after it waiting behind it; the partition's distance
// between the committed offset (0) and the highest handed out (0) is 1.
// Then the first is acked and the second handed out.
func TestCollectorExportsSubscriber(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "prom-sub", 1)
	b.ProduceKeyed(t, topic, "a", 3)
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: b.Addrs, RevokeTimeout: 5 * time.Second}, ConsumerGroup: "billing", MaxInFlight: 8,
		StallTimeout: time.Millisecond}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	c := idemprom.NewCollector()
	c.AddSubscriber(sub)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))

	first := <-ch
	require.Eventually(t, func() bool {
		s := sub.Stats()
		return s.KeysWaiting == 2 && s.StalledKeys == 1 && s.Partitions[0].StalledFor > 0
	}, time.Minute, 5*time.Millisecond)
	expected := `
# HELP idem_kafka_in_flight parallel.Subscriber: messages handed out and not yet acked or nacked (at most MaxInFlight).
# TYPE idem_kafka_in_flight gauge
idem_kafka_in_flight{consumer_group="billing"} 1
# HELP idem_kafka_keys_waiting parallel.Subscriber: records waiting for an earlier message of their key (OrderPartition: of their partition).
# TYPE idem_kafka_keys_waiting gauge
idem_kafka_keys_waiting{consumer_group="billing"} 2
# HELP idem_kafka_max_in_flight parallel.Subscriber: MaxInFlight (the bound of idem_kafka_in_flight).
# TYPE idem_kafka_max_in_flight gauge
idem_kafka_max_in_flight{consumer_group="billing"} 8
# HELP idem_kafka_partition_distance parallel.Subscriber: per held partition, the highest offset handed out + 1 - the committed offset (0 when nothing handed out is pending): how far processing runs ahead of the commit, which bounds what a crash makes run again.
# TYPE idem_kafka_partition_distance gauge
idem_kafka_partition_distance{consumer_group="billing",partition="0",topic="TOPIC"} 1
# HELP idem_kafka_partition_window parallel.Subscriber: per held partition, the records held from the committed offset on (at most PartitionWindow).
# TYPE idem_kafka_partition_window gauge
idem_kafka_partition_window{consumer_group="billing",partition="0",topic="TOPIC"} 3
# HELP idem_kafka_acked_total parallel.Subscriber: messages acked.
# TYPE idem_kafka_acked_total counter
idem_kafka_acked_total{consumer_group="billing"} 0
# HELP idem_kafka_sessions_total parallel.Subscriber: consumer-group sessions set up (the first join, then one per rebalance).
# TYPE idem_kafka_sessions_total counter
idem_kafka_sessions_total{consumer_group="billing"} 1
# HELP idem_kafka_commits_refused_total parallel.Subscriber: offset commits the broker refused (OffsetMetadataTooLarge, InvalidCommitOffsetSize): the committed offset does not move while they are refused.
# TYPE idem_kafka_commits_refused_total counter
idem_kafka_commits_refused_total{consumer_group="billing"} 0
`
	names := []string{"idem_kafka_in_flight", "idem_kafka_keys_waiting", "idem_kafka_max_in_flight", "idem_kafka_partition_distance",
		"idem_kafka_partition_window", "idem_kafka_acked_total", "idem_kafka_sessions_total", "idem_kafka_commits_refused_total"}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(strings.ReplaceAll(expected, "TOPIC", topic)), names...))
	n, err := testutil.GatherAndCount(reg)
	require.NoError(t, err)
	require.Equal(t, 15, n) // 12 per group, 3 per partition
	require.Equal(t, 1.0, testutil.ToFloat64(collectorOf(c, "idem_kafka_stalled_keys")), "the first, in flight past StallTimeout")
	require.Positive(t, testutil.ToFloat64(collectorOf(c, "idem_kafka_partition_stalled_seconds")))

	first.Ack()
	second := <-ch
	t.Cleanup(func() { second.Ack() })
	require.Eventually(t, func() bool { return sub.Stats().KeysWaiting == 1 }, time.Minute, 5*time.Millisecond)
	require.Equal(t, 1.0, testutil.ToFloat64(collectorOf(c, "idem_kafka_acked_total")))
}

// A key whose head stays in flight, with 11 records behind it, in a window
// of 4: the window keeps the head and two of them, the other nine are
// spilled (their payload dropped), and idem_kafka_spilled says so.
func TestCollectorExportsSpilled(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "prom-spill", 1)
	b.ProduceKeyed(t, topic, "a", 12)
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: b.Addrs, RevokeTimeout: 5 * time.Second}, ConsumerGroup: "billing", PartitionWindow: 4}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	c := idemprom.NewCollector()
	c.AddSubscriber(sub)

	first := <-ch
	t.Cleanup(func() { first.Ack() })
	require.Eventually(t, func() bool { s := sub.Stats(); return s.Spilled == 9 && s.KeysWaiting == 11 }, time.Minute, 5*time.Millisecond)
	require.Equal(t, 9.0, testutil.ToFloat64(collectorOf(c, "idem_kafka_spilled")))
	require.Equal(t, 11.0, testutil.ToFloat64(collectorOf(c, "idem_kafka_keys_waiting")))
}

// collectorOf narrows c to one metric name, for testutil.ToFloat64.
func collectorOf(c prometheus.Collector, name string) prometheus.Collector {
	return filtered{c, name}
}

type filtered struct {
	prometheus.Collector
	name string
}

func (f filtered) Collect(ch chan<- prometheus.Metric) {
	all := make(chan prometheus.Metric)
	go func() { f.Collector.Collect(all); close(all) }()
	for m := range all {
		if strings.Contains(m.Desc().String(), `"`+f.name+`"`) {
			ch <- m
		}
	}
}
