package contract_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// contractMarshaler lets Watermill's CQRS component decode with a
// contract: every message of the topic goes to the contract's handler, and
// Decode refuses what is not its event (permanent: the poison queue).
type contractMarshaler[T any] struct{ c *contract.Contract[T] }

func (m contractMarshaler[T]) Marshal(v any) (*message.Message, error) {
	return m.c.Message(context.Background(), *v.(*T))
}

func (m contractMarshaler[T]) Unmarshal(msg *message.Message, v any) error {
	ev, err := m.c.Decode(msg)
	if err != nil {
		return err
	}
	*v.(*T) = ev
	return nil
}

func (m contractMarshaler[T]) Name(any) string                         { return m.c.Type() }
func (m contractMarshaler[T]) NameFromMessage(*message.Message) string { return m.c.Type() }

// A typed CQRS handler behind the dedup middleware, over the real broker
// protocol: v1 and v2 events (one handler, one type, through the
// upcaster), a duplicate, and every kind of bad input. Each good event is
// applied once; each bad one lands on the poison topic on its first
// attempt, with the field and the rule in its reason, and leaves no claim.
func TestTypedHandlerRoutesBadInputToPoison(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	logger := watermill.NopLogger{}
	db := pgtest.New(t, 6)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, `CREATE TABLE invoice (event_id uuid NOT NULL, order_id text NOT NULL, amount numeric NOT NULL, channel text NOT NULL)`)

	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "orders", 2)
	poisonTopic := broker.Topic(t, "orders-poison", 1)
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	v1, err := contract.New[OrderConfirmed](contract.Config{Type: "order.confirmed.v1", AggregateIDField: "orderId", MaxSize: 2048})
	require.NoError(t, err)
	v2, err := contract.New[OrderConfirmedV2](contract.Config{Type: "order.confirmed.v2", AggregateIDField: "orderId", MaxSize: 2048})
	require.NoError(t, err)
	require.NoError(t, contract.Upcast(v2, v1, upV1))

	// Good events: v1 (one with a BOM and a field from a newer producer), v2, a duplicate.
	var good []*message.Message
	for i := range 4 {
		m, err := v1.Message(ctx, OrderConfirmed{OccurredAt: time.Now().UTC(), OrderID: fmt.Sprintf("o-%d", i), CustomerID: "c",
			TotalAmount: "10.00", Currency: "EUR", Items: []Item{{SKU: "A", Quantity: 1}}})
		require.NoError(t, err)
		good = append(good, m)
	}
	good[0].Payload = append([]byte("\xef\xbb\xbf"), good[0].Payload...)
	good[1].Payload = []byte(strings.Replace(string(good[1].Payload), `"currency"`, `"giftWrap":true,"currency"`, 1))
	for i := range 3 {
		m, err := v2.Message(ctx, OrderConfirmedV2{OrderID: fmt.Sprintf("o2-%d", i), Total: Money{Amount: "5.50", Currency: "USD"}, Channel: "store"})
		require.NoError(t, err)
		good = append(good, m)
	}
	dup := good[4].Copy()

	// Bad input, each with a valid event id (header and payload) so that
	// the contract, not the event-id rule, refuses it.
	bad := map[string]string{} // event id -> the reason's expected text
	var badMsgs []*message.Message
	addBad := func(old, new, want string, meta ...string) {
		id := publisher.NewEventID().String()
		p := strings.Replace(strings.Replace(goodPayload, old, new, 1), "0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f", id, 1)
		require.NotEqual(t, goodPayload, p, old)
		m := msgOf(p, append(meta, publisher.MetadataEventID, id)...)
		m.UUID = id
		bad[id] = want
		badMsgs = append(badMsgs, m)
	}
	addBad(`"customerId":"c-1",`, ``, `field "customerId" breaks rule required`)
	addBad(`"customerId":"c-1"`, `"customerId":null`, `field "customerId" breaks rule required`)
	addBad(`"orderId":"o-1"`, `"orderId":1`, `field "orderId" breaks rule type`)
	addBad(`"quantity":2`, `"quantity":1001`, `field "items[0].quantity" breaks rule lte=1000`)
	addBad(`"totalAmount":"129.90"`, `"totalAmount":129.90`, `field "totalAmount" breaks rule type`)
	addBad(`"currency":"EUR"`, `"currency":"EURO"`, `field "currency" breaks rule iso4217`)
	addBad(`"order.confirmed.v1"`, `"order.shipped.v1"`, `field "eventType" breaks rule event_type`)
	addBad(`"order.confirmed.v1"`, `"order.confirmed.v3"`, `field "eventType" breaks rule version=order.confirmed.v3`)
	addBad(`"currency":"EUR"`, `"currency":"EUR","currency":"USD"`, `field "currency" breaks rule duplicate_key`)
	addBad(`"customerId":"c-1"`, `"customerId":"c-1","pad":"`+strings.Repeat("x", 2048)+`"`, `breaks rule max_size=2048`)
	addBad(`"order.confirmed.v1"`, `"order.confirmed.v2"`, `contract order.confirmed.v2: field "total" breaks rule required`, "event_type", "order.confirmed.v2")
	require.NoError(t, pub.Publish(topic, append(append(append([]*message.Message{}, good...), dup), badMsgs...)...))

	// The poison topic's reader.
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
			poisoned[m.Metadata.Get(publisher.MetadataEventID)] = m
			mu.Unlock()
			m.Ack()
		}
	}()

	// The consumer: poison queue, retry, dedup, then the typed handler.
	group := topic + "-billing"
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: group, Table: table}, logger)
	require.NoError(t, err)
	poison, err := wmiddleware.PoisonQueueWithFilter(pub, poisonTopic, idem.IsPermanent)
	require.NoError(t, err)
	var mu2 sync.Mutex
	attempts := map[string]int{}
	retry := wmiddleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond,
		ShouldRetry: func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware, func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			mu2.Lock()
			attempts[m.Metadata.Get(publisher.MetadataEventID)]++
			mu2.Unlock()
			return h(m)
		}
	})
	processor, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) { return topic, nil },
		SubscriberConstructor: func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: broker.Addrs}, group)
			if err != nil {
				return nil, err
			}
			return kafka.NewSubscriber(cfg, logger)
		},
		Marshaler: contractMarshaler[OrderConfirmedV2]{v2},
		Logger:    logger,
	})
	require.NoError(t, err)
	require.NoError(t, processor.AddHandlers(cqrs.NewEventHandler("billing", func(ctx context.Context, ev *OrderConfirmedV2) error {
		id, _ := idem.EventIDFromContext(ctx)
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO invoice VALUES ($1, $2, $3, $4)`,
			id, ev.OrderID, ev.Total.Amount, ev.Channel)
		return err
	})))
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()

	// Wait (bounded by ctx) until every good event is applied and every bad one poisoned.
	for {
		mu.Lock()
		n := len(poisoned)
		mu.Unlock()
		if n == len(bad) && db.Count(t, `SELECT 1 FROM invoice`) == len(good) {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("poisoned %d of %d, applied %d of %d", n, len(bad), db.Count(t, `SELECT 1 FROM invoice`), len(good))
		case <-time.After(50 * time.Millisecond):
		}
	}

	mu.Lock()
	defer mu.Unlock()
	for id, want := range bad {
		m, ok := poisoned[id]
		require.True(t, ok, "%s reached the poison topic", want)
		require.Contains(t, m.Metadata.Get(wmiddleware.ReasonForPoisonedKey), want)
		mu2.Lock()
		require.Equal(t, 1, attempts[id], "%s: never retried", want)
		mu2.Unlock()
		require.Zero(t, db.Count(t, `SELECT 1 FROM processed_event WHERE event_id = $1::uuid`, id), "%s: no claim left", want)
	}
	for _, m := range good {
		id := m.Metadata.Get(publisher.MetadataEventID)
		require.NotContains(t, poisoned, id)
		require.Equal(t, 1, db.Count(t, `SELECT 1 FROM invoice WHERE event_id = $1::uuid`, id))
	}
	require.Equal(t, 4, db.Count(t, `SELECT 1 FROM invoice WHERE channel = 'web'`), "v1 events were upcast")
}
