package idemkafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// A member whose handler never returns must not hold its group's
// rebalance: with WatermillSubscriberConfig it gives its partitions up
// RevokeTimeout after the session ended, and a joining member consumes
// them, the message still in flight included (its offset was never
// committed). watermill-kafka's own ConsumeClaim waits for that message
// however long it takes, and the group consumes nothing until the
// coordinator's rebalance deadline (here 50 s) removes the member.
func TestWatermillSubscriberGivesUpARevokedPartitionAfterRevokeTimeout(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "revoke", 2)
	group := "revoke-" + topic

	// One record on each partition.
	pcfg := sarama.NewConfig()
	pcfg.Producer.Return.Successes = true
	pcfg.Producer.Partitioner = sarama.NewManualPartitioner
	prod, err := sarama.NewSyncProducer(broker.Addrs, pcfg)
	require.NoError(t, err)
	for p := range int32(2) {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		_, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: topic, Partition: p, Value: sarama.ByteEncoder(m.Payload),
			Headers: []sarama.RecordHeader{{Key: []byte("_watermill_message_uuid"), Value: []byte(m.UUID)}}})
		require.NoError(t, err)
	}
	require.NoError(t, prod.Close())

	base := sarama.NewConfig()
	base.Consumer.Group.Rebalance.Timeout = 50 * time.Second
	base.Consumer.Group.Session.Timeout = 6 * time.Second
	base.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	cc := idemkafka.ClientConfig{Brokers: broker.Addrs, Sarama: base, RevokeTimeout: 500 * time.Millisecond}
	subscribe := func(name string) (<-chan *message.Message, func()) {
		sc, err := idemkafka.WatermillSubscriberConfig(cc, group)
		require.NoError(t, err)
		sub, err := kafka.NewSubscriber(sc, watermill.NopLogger{})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err, name)
		return ch, func() { cancel(); require.NoError(t, sub.Close()) }
	}

	// a owns both partitions and never finishes its first message.
	chA, closeA := subscribe("a")
	defer closeA()
	var stuck *message.Message
	select {
	case stuck = <-chA:
	case <-time.After(30 * time.Second):
		t.Fatal("a received nothing")
	}

	// b joins: the group rebalances; a's handler is still running.
	chB, closeB := subscribe("b")
	defer closeB()
	select {
	case m := <-chB:
		// One record per partition, none committed: whichever partition b
		// got, it starts at its first record, the one a still holds
		// included.
		m.Ack()
		p, _ := kafka.MessagePartitionFromCtx(m.Context())
		sp, _ := kafka.MessagePartitionFromCtx(stuck.Context())
		if p == sp {
			require.Equal(t, stuck.UUID, m.UUID, "b got a's partition at the message a still holds")
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("b consumed nothing in 30 s (rebalance deadline 50 s): a held the rebalance with its message in flight")
	}
}
