package middleware_test

import (
	"context"
	"errors"
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

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// withIDs returns a message with header (when not empty) as event_id
// metadata and payloadID (when not empty) as the JSON field eventId.
func withIDs(header, payloadID string) *message.Message {
	payload := `{"amount":1}`
	if payloadID != "" {
		payload = `{"amount":1,"eventId":"` + payloadID + `"}`
	}
	m := message.NewMessage(uuid.NewString(), []byte(payload))
	if header != "" {
		m.Metadata.Set(publisher.MetadataEventID, header)
	}
	return m
}

// By default a header and a payload id that disagree are refused before any
// transaction: typed, permanent, the handler not run. Agreeing ids are one
// event.
func TestHeaderPayloadMismatchIsRefusedByDefault(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", nil).Middleware(f.insertHandler(1, &calls))

	header, inPayload := publisher.NewEventID(), publisher.NewEventID()
	f.sql.reset()
	_, err := h(withIDs(header.String(), inPayload.String()))
	require.ErrorIs(t, err, publisher.ErrEventIDMismatch)
	require.True(t, idem.IsPermanent(err), "routable to the poison queue")
	var ee *publisher.EventIDError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, publisher.ErrEventIDMismatch, ee.Reason)
	require.Equal(t, "payload", ee.Source)
	require.Contains(t, err.Error(), header.String())
	require.Contains(t, err.Error(), inPayload.String())
	require.Zero(t, f.sql.total(), "no statement sent, no transaction opened")

	// A payload eventId that cannot be compared with the header is refused too.
	_, err = h(withIDs(header.String(), "order-42"))
	require.ErrorIs(t, err, publisher.ErrInvalidEventID)
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "payload", ee.Source)

	// The same id in both places (any case): processed once.
	for _, p := range []string{header.String(), header.String(), fmt.Sprintf("%X", header[:4]) + header.String()[8:]} {
		_, err := h(withIDs(header.String(), p))
		require.NoError(t, err)
	}
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", header))
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", inPayload))
}

// publisher.EventIDFromMetadata(true) is the opt-out: the header wins, the payload is
// the fallback only.
func TestEventIDFromMetadataFirst(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", func(c *idem.Config) { c.EventIDFunc = publisher.EventIDFromMetadata(true) }).Middleware(f.insertHandler(1, &calls))

	header, inPayload := publisher.NewEventID(), publisher.NewEventID()
	_, err := h(withIDs(header.String(), inPayload.String()))
	require.NoError(t, err)
	_, err = h(withIDs(header.String(), "order-42"))
	require.NoError(t, err, "the payload is not read when the header is there")
	require.EqualValues(t, 1, calls.Load(), "the second message is a duplicate of the first")
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", header))
	require.Zero(t, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", inPayload))

	// No header: the payload is the fallback.
	_, err = h(withIDs("", inPayload.String()))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", inPayload))

	// A malformed header is refused even when the payload has a valid id:
	// the header is authoritative, never silently replaced.
	_, err = h(withIDs("garbage", inPayload.String()))
	require.ErrorIs(t, err, publisher.ErrInvalidEventID)
	require.EqualValues(t, 2, calls.Load())
}

func TestIsPermanent_EventIDMismatch(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		publisher.ErrEventIDMismatch,
		&publisher.EventIDError{Reason: publisher.ErrEventIDMismatch, Source: "payload"},
		fmt.Errorf("outbox: %w", &publisher.EventIDError{Reason: publisher.ErrEventIDMismatch}),
	} {
		require.True(t, idem.IsPermanent(err), "%v", err)
	}
	require.False(t, errors.Is(publisher.ErrEventIDMismatch, publisher.ErrInvalidEventID), "a sentinel of its own")
}

// Over Kafka, wired as documented (PoisonQueueWithFilter(IsPermanent) →
// Retry → dedup): a message from a foreign producer whose header and
// payload ids disagree lands on the poison topic with the reason, on its
// first attempt; agreeing messages are applied once.
func TestRouterRoutesEventIDMismatchToPoisonTopic(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	f := newLedgerFixture(t)
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "mismatch", 2)
	poisonTopic := broker.Topic(t, "mismatch-poison", 1)
	logger := watermill.NopLogger{}

	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	// The Kafka publisher does not stamp: these are a foreign producer's bytes.
	x := publisher.NewEventID().String()
	agree, again := withIDs(x, x), withIDs(x, x)
	mismatch := withIDs(publisher.NewEventID().String(), publisher.NewEventID().String())
	require.NoError(t, pub.Publish(topic, agree, mismatch, again))

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

	group := topic + "-ledger"
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(subCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	poison, err := wmiddleware.PoisonQueueWithFilter(pub, poisonTopic, idem.IsPermanent)
	require.NoError(t, err)
	var attempts atomic.Int32
	retry := wmiddleware.Retry{
		MaxRetries:      3,
		InitialInterval: 10 * time.Millisecond,
		ShouldRetry: func(p wmiddleware.RetryParams) bool {
			attempts.Add(1)
			return !idem.IsPermanent(p.Err)
		},
	}
	var calls atomic.Int32
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	dedup := f.dedup(t, group, nil)
	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware)
	router.AddConsumerHandler("ledger", topic, sub, func(m *message.Message) error {
		_, err := f.insertHandler(1, &calls)(m)
		return err
	})
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()

	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		st := dedup.Stats()
		return len(poisoned) == 1 && st.Processed == 1 && st.Duplicates == 1
	}, 60*time.Second, 50*time.Millisecond, "the mismatch poisoned, the agreeing copies processed and deduplicated")

	mu.Lock()
	defer mu.Unlock()
	p, ok := poisoned[mismatch.UUID]
	require.True(t, ok, "the mismatched message reached the poison topic")
	require.Contains(t, p.Metadata.Get(wmiddleware.ReasonForPoisonedKey), publisher.ErrEventIDMismatch.Error())
	require.Equal(t, string(mismatch.Payload), string(p.Payload))
	require.EqualValues(t, 1, attempts.Load(), "the permanent error was not retried")
	require.EqualValues(t, 1, calls.Load(), "the agreeing copies are one event, applied once")
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1::uuid", x))
	require.Equal(t, 1, f.claims(t))
}
