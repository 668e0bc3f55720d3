package franz_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kversion"
	"go.uber.org/goleak"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics (used by Sarama) runs one global ticker for the process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// KIP-848 on a broker without it (Kafka 3.9) is refused with a typed
// error, where franz-go alone would fall back to the classic protocol.
func TestSubscriberRefusesKIP848WhereTheBrokerLacksIt(t *testing.T) {
	t.Parallel()
	b := kafkatest.StartOld(t, kversion.V3_9_0())
	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "g", GroupProtocol: "consumer"}, nil)
	require.NoError(t, err)
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), "t")
	var unsupported *franz.UnsupportedError
	require.True(t, errors.As(err, &unsupported), "got %v", err)
	require.Equal(t, "ConsumerGroupHeartbeat v1", unsupported.API)
}

func TestSubscriberConfigErrors(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]franz.SubscriberConfig{
		"Brokers":         {ConsumerGroup: "g"},
		"ConsumerGroup":   {Brokers: []string{"x"}},
		"GroupProtocol":   {Brokers: []string{"x"}, ConsumerGroup: "g", GroupProtocol: "next"},
		"Ordering":        {Brokers: []string{"x"}, ConsumerGroup: "g", Ordering: 9},
		"MaxInFlight":     {Brokers: []string{"x"}, ConsumerGroup: "g", MaxInFlight: -1},
		"PartitionWindow": {Brokers: []string{"x"}, ConsumerGroup: "g", PartitionWindow: -1},
		"RevokeTimeout":   {Brokers: []string{"x"}, ConsumerGroup: "g", RevokeTimeout: -1},
		"InstanceID":      {Brokers: []string{"x"}, ConsumerGroup: "g", InstanceID: "pod 1"},
		// A share group has no offsets to keep in PostgreSQL.
		"Progress": {Brokers: []string{"x"}, ShareGroup: "s", Ordering: parallel.OrderNone, Progress: (*pgxpool.Pool)(nil)},
	} {
		_, err := franz.NewSubscriber(cfg, nil)
		require.ErrorContains(t, err, "invalid config: "+field+":")
	}
	_, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ShareGroup: "s", Ordering: parallel.OrderNone, InstanceID: "pod-1"}, nil)
	require.ErrorContains(t, err, "invalid config: InstanceID: not with a share group")
	_, err = franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ConsumerGroup: "g",
		ClientOpts: []kgo.Opt{kgo.RebalanceTimeout(5 * time.Second)}}, nil)
	require.ErrorContains(t, err, "invalid config: RevokeTimeout: 10s + 1s for the final commit must be shorter than the rebalance timeout of ClientOpts (5s)")
	_, err = franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ConsumerGroup: "g", RevokeTimeout: time.Second,
		ClientOpts: []kgo.Opt{kgo.RebalanceTimeout(5 * time.Second)}}, nil)
	require.NoError(t, err)
	_, err = franz.NewPublisher(franz.PublisherConfig{}, nil)
	require.ErrorContains(t, err, "Brokers: required")
}

// Records written by watermill-kafka (idemkafka.Marshaler) reach a franz
// handler with their UUID, metadata, key, partition and offset, and the
// franz Publisher refuses the reserved UUID metadata.
func TestSubscriberReadsWatermillKafkaRecords(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "compat", 1)
	pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: b.Addrs})
	require.NoError(t, err)
	wpub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	defer wpub.Close()
	in := message.NewMessage(watermill.NewUUID(), []byte("payload"))
	in.Metadata.Set(publisher.MetadataPartitionKey, "agg-1")
	in.Metadata.Set("color", "blue")
	require.NoError(t, wpub.Publish(topic, in))

	fpub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	defer fpub.Close()
	bad := message.NewMessage(watermill.NewUUID(), nil)
	bad.Metadata.Set(kafka.UUIDHeaderKey, "x")
	require.ErrorContains(t, fpub.Publish(topic, bad), "reserved")

	ch := subscribe(t, franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "compat"}, topic)
	select {
	case got := <-ch:
		require.Equal(t, in.UUID, got.UUID)
		require.Equal(t, "payload", string(got.Payload))
		require.Equal(t, "blue", got.Metadata.Get("color"))
		key, _ := kafka.MessageKeyFromCtx(got.Context())
		require.Equal(t, "agg-1", string(key))
		part, ok := kafka.MessagePartitionFromCtx(got.Context())
		require.True(t, ok)
		require.EqualValues(t, 0, part)
		off, ok := kafka.MessagePartitionOffsetFromCtx(got.Context())
		require.True(t, ok)
		require.EqualValues(t, 0, off)
		got.Ack()
		select {
		case <-got.Context().Done(): // a message's context ends with its ack
		case <-time.After(60 * time.Second):
			t.Fatal("the message's context outlived its ack")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no message")
	}
}

// A transactional Publisher writes each Publish call as one transaction:
// a call with a record the client refuses writes none of its records, and
// the Subscriber (read_committed) never hands out the aborted ones.
func TestTransactionalPublisherAbortsAFailedCall(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "txn", 1)
	pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs, TransactionalID: "txn-" + topic,
		ClientOpts: []kgo.Opt{kgo.ProducerBatchMaxBytes(1 << 10)}}, nil)
	require.NoError(t, err)
	defer pub.Close()
	aborted := message.NewMessage(watermill.NewUUID(), []byte("aborted"))
	huge := message.NewMessage(watermill.NewUUID(), make([]byte, 4<<10))
	require.Error(t, pub.Publish(topic, aborted, huge))
	committed := message.NewMessage(watermill.NewUUID(), []byte("committed"))
	require.NoError(t, pub.Publish(topic, committed))

	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "txn"}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	select {
	case got := <-ch:
		require.Equal(t, "committed", string(got.Payload), "the aborted call's record was handed out")
		got.Ack()
	case <-time.After(60 * time.Second):
		t.Fatal("no message")
	}
}

// A partition whose window fills beside an idle one keeps flowing. When a
// full partition is resumed, franz-go adds it to the broker's next fetch,
// after the one in flight, and a fetch for idle partitions only waits
// FetchMaxWait at the broker (franz-go's default: 5 s): with that default
// each refill of the window waited 5 s, and these 50 windows' worth took
// over 4 minutes. The Subscriber's own FetchMaxWait, 100 ms, keeps them to
// a few seconds (this tiny window drains before each refill arrives).
func TestSubscriberFullPartitionBesideAnIdleOneKeepsFlowing(t *testing.T) {
	t.Parallel()
	b := kafkatest.Start(t)
	topic := b.Topic(t, "refill", 2)
	const n, window = 400, 8
	pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	defer pub.Close()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		// One key: one partition gets them all, the other stays idle.
		msgs[i] = publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte("x")), "hot")
	}
	require.NoError(t, pub.Publish(topic, msgs...))

	ch := subscribe(t, franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "refill", PartitionWindow: window, PollRecords: window}, topic)
	// A liveness bound, far from both outcomes: about 5 s with the fix,
	// over 4 minutes without it (144 of 400 records in 90 s).
	deadline := time.After(90 * time.Second)
	for i := range n {
		select {
		case m := <-ch:
			require.Equal(t, msgs[i].UUID, m.UUID, "the key's order")
			m.Ack()
		case <-deadline:
			t.Fatalf("%d of %d records in 90 s: the refills of the full partition wait for the idle one's fetch", i, n)
		}
	}
}

// subscribe starts a Subscriber of cfg on topic, closed when the test ends.
func subscribe(t *testing.T, cfg franz.SubscriberConfig, topic string) <-chan *message.Message {
	t.Helper()
	sub, err := franz.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return ch
}
