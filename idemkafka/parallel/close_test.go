package parallel_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// A stop is bounded even while the coordinator holds the member's JoinGroup
// (it may, for the rebalance timeout, while another member does not
// rejoin): Close returns RevokeTimeout + a grace later, closing the Kafka
// client under the pending request, instead of waiting for its read
// timeout (65 s with the default rebalance timeout).
func TestSubscriberCloseIsBoundedWhileAJoinGroupIsHeld(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	if broker.Fake == nil {
		t.Skip("holds a JoinGroup in the in-process broker")
	}
	topic := broker.Topic(t, "held-join", 1)
	held := make(chan struct{}, 1)
	broker.Fake.ControlKey(int16(kmsg.JoinGroup), func(kmsg.Request) (kmsg.Response, error, bool) {
		broker.Fake.KeepControl()
		select {
		case held <- struct{}{}:
		default:
		}
		return nil, nil, true // never answered
	})
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client: idemkafka.ClientConfig{Brokers: broker.Addrs, RevokeTimeout: time.Second}, ConsumerGroup: "held-" + topic,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	_, err = sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("no JoinGroup reached the broker")
	}
	closed := make(chan struct{})
	go func() { _ = sub.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(40 * time.Second):
		t.Fatal("Close waited for the held JoinGroup (its read timeout is 65 s)")
	}
}
