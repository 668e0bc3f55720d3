package franz_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// needShareGroups skips the test on a real cluster (KAFKA_BROKERS) unless
// KAFKA_SHARE_GROUPS says it has share groups (Kafka 4.2+); the in-process
// broker has them.
func needShareGroups(t *testing.T) {
	t.Helper()
	if kafkatest.External() != nil && os.Getenv("KAFKA_SHARE_GROUPS") == "" {
		t.Skip("KAFKA_BROKERS is set: set KAFKA_SHARE_GROUPS=1 too when the cluster has share groups")
	}
}

func TestShareGroupConfigRefusesKeyOrder(t *testing.T) {
	t.Parallel()
	_, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ShareGroup: "s"}, nil)
	require.ErrorContains(t, err, "invalid config: Ordering: key with a share group")
	_, err = franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ShareGroup: "s", Ordering: parallel.OrderPartition}, nil)
	require.ErrorContains(t, err, "invalid config: Ordering: partition with a share group")
	_, err = franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ShareGroup: "s", ConsumerGroup: "g", Ordering: parallel.OrderNone}, nil)
	require.ErrorContains(t, err, "invalid config: ShareGroup:")
	_, err = franz.NewSubscriber(franz.SubscriberConfig{Brokers: []string{"x"}, ShareGroup: "s", Ordering: parallel.OrderNone, ShareOffsetReset: "oldest"}, nil)
	require.ErrorContains(t, err, "invalid config: ShareOffsetReset:")
}

// shareRun consumes topic in share group with handler h behind
// RecordErrors (no router: a nil error acks, any other nacks) until stop
// is called, recording each message's deliveries by payload.
type shareRun struct {
	mu         sync.Mutex
	deliveries map[string][]int32
}

func (r *shareRun) count(payload string) []int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int32(nil), r.deliveries[payload]...)
}

func (r *shareRun) start(t *testing.T, b *kafkatest.Broker, group, topic string, h message.HandlerFunc) (stop func()) {
	t.Helper()
	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ShareGroup: group, Ordering: parallel.OrderNone,
		MaxDeliveries: 3, RevokeTimeout: time.Second}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	wrapped := franz.RecordErrors(func(msg *message.Message) ([]*message.Message, error) {
		n, ok := franz.DeliveryCount(msg.Context())
		require.True(t, ok)
		r.mu.Lock()
		r.deliveries[string(msg.Payload)] = append(r.deliveries[string(msg.Payload)], n)
		r.mu.Unlock()
		return h(msg)
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for msg := range ch {
			if _, err := wrapped(msg); err != nil {
				msg.Nack()
			} else {
				msg.Ack()
			}
		}
	}()
	return func() {
		cancel()
		require.NoError(t, sub.Close())
		<-done
	}
}

// A share group: an ack accepts (never delivered again), a nack releases
// (delivered again, its delivery count one higher), a permanent error
// rejects, and a failure at delivery MaxDeliveries becomes permanent and
// rejects. A second member of the group after the first left sees none of
// them again, only a new record.
func TestShareGroupAcknowledgements(t *testing.T) {
	t.Parallel()
	needShareGroups(t)
	b := kafkatest.Start(t)
	topic := b.Topic(t, "share", 1)
	pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	defer pub.Close()
	for _, p := range []string{"ok", "flaky", "permanent", "failing", "marker1"} {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(p))))
	}
	run := &shareRun{deliveries: map[string][]int32{}}
	h := func(msg *message.Message) ([]*message.Message, error) {
		switch string(msg.Payload) {
		case "flaky":
			if n, _ := franz.DeliveryCount(msg.Context()); n == 1 {
				return nil, errors.New("first attempt fails")
			}
		case "permanent":
			return nil, idem.Permanent(errors.New("bad input"))
		case "failing":
			return nil, errors.New("always fails")
		}
		return nil, nil
	}
	group := "share-acks"
	stop := run.start(t, b, group, topic, h)
	wait := func(what string, cond func() bool) {
		t.Helper()
		require.Eventually(t, cond, 60*time.Second, 10*time.Millisecond, what)
	}
	wait("every record settled", func() bool {
		return len(run.count("marker1")) == 1 && len(run.count("flaky")) == 2 && len(run.count("failing")) == 3
	})
	stop()
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("marker2"))))
	stop = run.start(t, b, group, topic, h)
	wait("the new record", func() bool { return len(run.count("marker2")) == 1 })
	stop()
	require.Equal(t, []int32{1}, run.count("ok"), "accepted once")
	require.Equal(t, []int32{1, 2}, run.count("flaky"), "released, then accepted")
	require.Equal(t, []int32{1}, run.count("permanent"), "rejected at once")
	require.Equal(t, []int32{1, 2, 3}, run.count("failing"), "rejected at MaxDeliveries")
}

// With a poison queue filtered by idem.IsPermanent before RecordErrors, a
// record failing at delivery MaxDeliveries goes to the poison topic (and
// is accepted).
func TestShareGroupPoisonQueueAfterMaxDeliveries(t *testing.T) {
	t.Parallel()
	needShareGroups(t)
	b := kafkatest.Start(t)
	topic := b.Topic(t, "share-poison", 1)
	poisonTopic := b.Topic(t, "share-poisoned", 1)
	pub, err := franz.NewPublisher(franz.PublisherConfig{Brokers: b.Addrs}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("failing"))))

	sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ShareGroup: "share-poison", Ordering: parallel.OrderNone,
		MaxDeliveries: 2, RevokeTimeout: time.Second}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	pq, err := wmiddleware.PoisonQueueWithFilter(pub, poisonTopic, idem.IsPermanent)
	require.NoError(t, err)
	router.AddMiddleware(pq, franz.RecordErrors)
	var mu sync.Mutex
	var deliveries []int32
	router.AddConsumerHandler("h", topic, sub, func(msg *message.Message) error {
		n, _ := franz.DeliveryCount(msg.Context())
		mu.Lock()
		deliveries = append(deliveries, n)
		mu.Unlock()
		return errors.New("always fails")
	})
	ctx, cancel := context.WithCancel(context.Background())
	routerDone := make(chan struct{})
	go func() {
		defer close(routerDone)
		_ = router.Run(ctx)
	}()
	defer func() {
		cancel()
		<-routerDone
	}()

	poisoned, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ConsumerGroup: "poison-reader"}, nil)
	require.NoError(t, err)
	defer poisoned.Close()
	ch, err := poisoned.Subscribe(ctx, poisonTopic)
	require.NoError(t, err)
	select {
	case msg := <-ch:
		require.Equal(t, "failing", string(msg.Payload))
		require.Contains(t, msg.Metadata.Get(wmiddleware.ReasonForPoisonedKey), "delivery 2 of at most 2 failed")
		msg.Ack()
	case <-time.After(60 * time.Second):
		t.Fatal("nothing reached the poison topic")
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int32{1, 2}, deliveries)
}

// A handler that holds its record holds only its member's next poll: with
// ShareMembers 2 the other member hands out the other records meanwhile
// (all but those the held member has acquired); with 1, the lone member's
// next poll waits for the held record, and nothing but its batch comes
// (the control).
func TestShareGroupHeldRecordHoldsOnlyItsMember(t *testing.T) {
	t.Parallel()
	needShareGroups(t)
	b := kafkatest.Start(t)
	for _, members := range []int{2, 1} {
		t.Run(fmt.Sprintf("members=%d", members), func(t *testing.T) {
			t.Parallel()
			topic := b.Topic(t, "share-held", 1)
			const n = 20
			b.ProduceKeyed(t, topic, "k", n)
			sub, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: b.Addrs, ShareGroup: "held-" + topic, Ordering: parallel.OrderNone,
				MaxInFlight: 2 * members, ShareMembers: members}, nil)
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer func() { cancel(); require.NoError(t, sub.Close()) }()
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			var held *message.Message
			others := 0
			// Wait for the others well past the group's join and a poll's
			// round trip; with one member none comes after the held
			// record's batch.
			quiet := time.NewTimer(20 * time.Second)
			defer quiet.Stop()
		loop:
			for others < n-1 {
				select {
				case m := <-ch:
					if held == nil {
						held = m
						continue
					}
					others++
					m.Ack()
				case <-quiet.C:
					break loop
				}
			}
			// A member acquires its next batch (2 records) before it polls
			// it: those wait with the held record.
			if members == 1 {
				require.Less(t, others, 2, "one member handed out more than its batch while a record was held")
			} else {
				require.GreaterOrEqual(t, others, n-1-2, "a held record held the other member too")
			}
			held.Ack()
		})
	}
}
