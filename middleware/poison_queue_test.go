package middleware_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// poisonV7At returns a UUIDv7 whose timestamp is t.
func poisonV7At(t time.Time) uuid.UUID {
	id := publisher.NewEventID()
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()))
	copy(id[0:6], ms[2:8])
	return id
}

// Router wiring as documented: PoisonQueueWithFilter(IsPermanent) before
// Retry, then the dedup middleware. Bad messages land on the poison topic
// with their reason in metadata, good ones are each applied once, nothing is
// lost, and no permanent error is retried.
func TestRouterRoutesRefusedMessagesToPoisonTopic(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	f := newLedgerFixture(t)
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "orders", 2)
	poisonTopic := broker.Topic(t, "orders-poison", 1)
	logger := watermill.NopLogger{}

	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	// Input: 20 good events (one fails transiently on its first attempt),
	// a re-published duplicate, and six messages that can never be processed.
	var want int64
	var good []*message.Message
	for i := range 20 {
		m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"amount":%d}`, i+1)))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		m.Metadata.Set(publisher.MetadataPartitionKey, fmt.Sprintf("acct-%d", i%3))
		good = append(good, m)
		want += int64(i + 1)
	}
	dup := good[0].Copy()
	dup.UUID = uuid.NewString()
	transient := good[5].Metadata.Get(publisher.MetadataEventID)

	bad := map[string]string{} // message UUID -> expected reason text
	addBad := func(eventID, payload, reason string) *message.Message {
		m := message.NewMessage(uuid.NewString(), []byte(payload))
		if eventID != "" {
			m.Metadata.Set(publisher.MetadataEventID, eventID)
		}
		bad[m.UUID] = reason
		return m
	}
	badMsgs := []*message.Message{
		addBad("", "amount=1", publisher.ErrMissingEventID.Error()),
		addBad("garbage", `{"amount":1}`, publisher.ErrInvalidEventID.Error()),
		addBad(uuid.Nil.String(), `{"amount":1}`, publisher.ErrNilEventID.Error()),
		addBad(uuid.NewString(), `{"amount":1}`, publisher.ErrNotUUIDv7.Error()),
		addBad(poisonV7At(time.Now().Add(-30*24*time.Hour)).String(), `{"amount":1}`, deduplicator.ErrStaleEvent.Error()),
		addBad(publisher.NewEventID().String(), `{"amount":"lots"}`, idem.ErrMalformedPayload.Error()),
	}
	all := append(append(append([]*message.Message{}, good...), dup), badMsgs...)
	require.NoError(t, pub.Publish(topic, all...))

	// Poison topic reader.
	var mu sync.Mutex
	poisoned := map[string]*message.Message{}
	poisonSubCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, poisonTopic+"-reader")
	require.NoError(t, err)
	poisonSub, err := kafka.NewSubscriber(poisonSubCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = poisonSub.Close() })
	poisonMsgs, err := poisonSub.Subscribe(ctx, poisonTopic)
	require.NoError(t, err)
	go func() {
		for m := range poisonMsgs {
			mu.Lock()
			poisoned[m.UUID] = m
			mu.Unlock()
			m.Ack()
		}
	}()

	// The consumer.
	group := topic + "-ledger"
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	ageGroup(t, f.db, group) // its stale guard is on: the 30-day-old event is refused
	dedup := f.dedup(t, group, nil)
	poison, err := wmiddleware.PoisonQueueWithFilter(pub, poisonTopic, idem.IsPermanent)
	require.NoError(t, err)
	var permanentSeen atomic.Int32
	var failedOnce atomic.Bool
	retry := wmiddleware.Retry{
		MaxRetries:      3,
		InitialInterval: 10 * time.Millisecond,
		ShouldRetry: func(p wmiddleware.RetryParams) bool {
			if idem.IsPermanent(p.Err) {
				permanentSeen.Add(1)
				return false
			}
			return true
		},
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware)
	router.AddConsumerHandler("ledger", topic, sub, func(m *message.Message) error {
		var p struct {
			Amount int64 `json:"amount"`
		}
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			return fmt.Errorf("decode order %s: %w: %v", m.UUID, idem.ErrMalformedPayload, err)
		}
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx,
			"INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, $2, $3)", id, group, p.Amount); err != nil {
			return err
		}
		if id.String() == transient && failedOnce.CompareAndSwap(false, true) {
			return fmt.Errorf("transient failure of %s", id) // Retry runs it again in a new transaction
		}
		return nil
	})
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()

	require.Eventually(t, func() bool {
		mu.Lock()
		n := len(poisoned)
		mu.Unlock()
		return n == len(bad) && f.ledgerRows(t) == len(good)
	}, 60*time.Second, 50*time.Millisecond, "every good message applied and every bad one poisoned")

	mu.Lock()
	defer mu.Unlock()
	for id, reason := range bad {
		m, ok := poisoned[id]
		require.True(t, ok, "message %s reached the poison topic", id)
		got := m.Metadata.Get(wmiddleware.ReasonForPoisonedKey)
		require.Contains(t, got, reason, "message %s", id)
		require.Equal(t, topic, m.Metadata.Get(wmiddleware.PoisonedTopicKey))
		require.Equal(t, "ledger", m.Metadata.Get(wmiddleware.PoisonedHandlerKey))
	}
	for _, m := range good {
		require.NotContains(t, poisoned, m.UUID)
	}
	require.EqualValues(t, len(bad), permanentSeen.Load(), "each permanent error was poisoned on its first attempt, never retried")
	require.True(t, failedOnce.Load())

	var sum int64
	require.NoError(t, f.pool.QueryRow(ctx, "SELECT coalesce(sum(amount), 0) FROM ledger").Scan(&sum))
	require.Equal(t, want, sum)
	require.Equal(t, len(good), f.claims(t))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1::uuid", transient))
}
