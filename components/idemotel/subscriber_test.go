package idemotel_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/watermill-idempotency/components/idemotel"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// The parallel subscriber's stats: one message of key a in flight (not
// acked), the two after it waiting behind it; the partition's distance
// between the committed offset (0) and the highest handed out (0) is 1.
// Then the first is acked and the second handed out.
func TestMetricsExportSubscriber(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "otel-sub", 1)
	b.ProduceKeyed(t, topic, "a", 3)
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: b.Addrs, RevokeTimeout: 5 * time.Second}, ConsumerGroup: "billing", MaxInFlight: 8,
		StallTimeout: time.Millisecond}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	metrics, err := idemotel.New(mp)
	require.NoError(t, err)
	t.Cleanup(func() { _ = metrics.Close() })
	metrics.AddSubscriber(sub)

	first := <-ch
	require.Eventually(t, func() bool {
		s := sub.Stats()
		return s.KeysWaiting == 2 && s.StalledKeys == 1 && s.Partitions[0].StalledFor > 0
	}, time.Minute, 5*time.Millisecond)
	part := []attribute.KeyValue{group, attribute.String("messaging.destination.name", topic), attribute.String("messaging.destination.partition.id", "0")}
	got, err := collect(t, reader)
	require.NoError(t, err)
	require.EqualValues(t, 1, got.must(t, "idem.kafka.in_flight", group))
	require.EqualValues(t, 2, got.must(t, "idem.kafka.keys_waiting", group))
	require.EqualValues(t, 0, got.must(t, "idem.kafka.held", group))
	require.EqualValues(t, 0, got.must(t, "idem.kafka.spilled", group))
	require.EqualValues(t, 8, got.must(t, "idem.kafka.max_in_flight", group))
	require.EqualValues(t, 0, got.must(t, "idem.kafka.acked", group))
	require.EqualValues(t, 1, got.must(t, "idem.kafka.sessions", group))
	require.EqualValues(t, 0, got.must(t, "idem.kafka.commits_refused", group))
	require.EqualValues(t, 1, got.must(t, "idem.kafka.partition.distance", part...))
	require.EqualValues(t, 3, got.must(t, "idem.kafka.partition.window", part...))
	require.EqualValues(t, 1, got.must(t, "idem.kafka.stalled_keys", group), "the first, in flight past StallTimeout")
	require.Positive(t, got.must(t, "idem.kafka.partition.stalled", part...))

	first.Ack()
	second := <-ch
	t.Cleanup(func() { second.Ack() })
	require.Eventually(t, func() bool { return sub.Stats().KeysWaiting == 1 }, time.Minute, 5*time.Millisecond)
	got, err = collect(t, reader)
	require.NoError(t, err)
	require.EqualValues(t, 1, got.must(t, "idem.kafka.acked", group))
	require.EqualValues(t, 1, got.must(t, "idem.kafka.in_flight", group))
	require.EqualValues(t, 1, got.must(t, "idem.kafka.keys_waiting", group))
}

// A key whose head stays in flight, with 11 records behind it, in a window
// of 4: the window keeps the head and two of them, the other nine are
// spilled (their payload dropped), and idem.kafka.spilled says so.
func TestMetricsExportSpilled(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "otel-spill", 1)
	b.ProduceKeyed(t, topic, "a", 12)
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: b.Addrs, RevokeTimeout: 5 * time.Second}, ConsumerGroup: "billing", PartitionWindow: 4}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	metrics, err := idemotel.New(mp)
	require.NoError(t, err)
	t.Cleanup(func() { _ = metrics.Close() })
	metrics.AddSubscriber(sub)

	first := <-ch
	t.Cleanup(func() { first.Ack() })
	require.Eventually(t, func() bool { s := sub.Stats(); return s.Spilled == 9 && s.KeysWaiting == 11 }, time.Minute, 5*time.Millisecond)
	got, err := collect(t, reader)
	require.NoError(t, err)
	require.EqualValues(t, 9, got.must(t, "idem.kafka.spilled", group))
	require.EqualValues(t, 11, got.must(t, "idem.kafka.keys_waiting", group))
}
