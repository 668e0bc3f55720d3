// Package otelchain builds, for tests, the billing chain of the example
// (examples/billing) with OpenTelemetry tracing on, against the real
// PostgreSQL server and a Kafka-protocol broker: an order service whose
// business transaction writes order.confirmed.v1 to the outbox, the outbox
// forwarder, a billing consumer (dedup middleware) that charges a fake
// payment provider through the Idempotency-Key transport and returns
// billing.charged.v1 to the outbox, and a notification consumer of
// billing.charged.v1. Spans go to the SDK's in-memory exporter. Its tests
// prove that one trace runs from the business transaction to the last
// consumer; the subpackage saramainterop proves it with watermill-kafka's
// Sarama tracer on as well (global state, so in a process of its own).
package otelchain

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
	"github.com/idemkit/watermill-idempotency/tests/spantree"
)

// Consumer groups of the chain.
const (
	GroupBilling      = "billing-order-confirmed"
	GroupNotification = "notification-billing-charged"
)

// Secret is in every order's payload (a card number and an e-mail address):
// no span attribute may contain it.
const Secret = "card-4242-4242-4242-4242 alice@example.com"

// BaggageMember is the baggage the order service's request carries: it
// travels in the outbox rows and the Kafka headers to every consumer.
const BaggageMember = "tenant=acme"

// Env is one test's chain: its PostgreSQL schema (processed_event, orders,
// ledger, notifications, the outbox tables), the broker and its two topics,
// the payment provider and the tracer provider under test.
type Env struct {
	DB       *pgtest.DB
	Table    deduplicator.TableConfig
	Broker   *kafkatest.Broker
	Outbox   *outbox.Outbox
	Orders   string // order.confirmed.v1
	Charged  string // billing.charged.v1
	Provider *Provider
	Exp      *tracetest.InMemoryExporter
	TP       *sdktrace.TracerProvider
	Logger   watermill.LoggerAdapter
}

// New sets up the chain's storage, topics, payment provider and an SDK
// TracerProvider exporting synchronously to an in-memory exporter. Nothing
// runs yet.
func New(t *testing.T) *Env {
	t.Helper()
	ctx := context.Background()
	e := &Env{DB: pgtest.New(t, 10), Broker: kafkatest.Start(t), Logger: watermill.NopLogger{}}
	e.Table = deduplicator.TableConfig{Schema: e.DB.Schema}
	must(t, migrate.Up(ctx, e.DB.Pool, deduplicator.MigrationLine(e.Table)))
	e.DB.Exec(t, `CREATE TABLE orders (id text PRIMARY KEY, customer_id text NOT NULL, amount numeric(12,2) NOT NULL)`)
	e.DB.Exec(t, `CREATE TABLE ledger (order_id text PRIMARY KEY, charge_id text NOT NULL, event_id uuid NOT NULL)`)
	e.DB.Exec(t, `CREATE TABLE notifications (order_id text PRIMARY KEY, event_id uuid NOT NULL)`)
	e.Orders = e.Broker.Topic(t, "orders", 1)
	e.Charged = e.Broker.Topic(t, "charged", 1)
	var err error
	e.Outbox, err = outbox.New(outbox.Config{Schema: e.DB.Schema, Topics: []string{e.Orders, e.Charged}}, e.Logger)
	must(t, err)
	must(t, migrate.Up(ctx, e.DB.Pool, outbox.MigrationLine(e.Outbox.Config(), e.Orders), outbox.MigrationLine(e.Outbox.Config(), e.Charged)))
	e.Provider = NewProvider(t)
	e.Exp = tracetest.NewInMemoryExporter()
	e.TP = sdktrace.NewTracerProvider(sdktrace.WithSyncer(e.Exp))
	t.Cleanup(func() { _ = e.TP.Shutdown(context.Background()) })
	return e
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Order is the payload of order.confirmed.v1.
type Order struct {
	OrderID    string `json:"orderId"`
	CustomerID string `json:"customerId"`
	Amount     string `json:"amount"`
	Card       string `json:"card"`
}

// PlaceOrder is the order service's business transaction, in a span of its
// own (the trace's root, unless ctx carries one): BEGIN, INSERT the order,
// write order.confirmed.v1 to the outbox on the same transaction, COMMIT.
// The request carries [BaggageMember]. It returns the span's context.
func (e *Env) PlaceOrder(ctx context.Context, tp trace.TracerProvider, orderID string) (trace.SpanContext, error) {
	member, err := baggage.Parse(BaggageMember)
	if err != nil {
		return trace.SpanContext{}, err
	}
	ctx = baggage.ContextWithBaggage(ctx, member)
	ctx, span := tp.Tracer("order-service").Start(ctx, "confirm order", trace.WithSpanKind(trace.SpanKindServer))
	defer span.End()
	tx, err := e.DB.Pool.Begin(ctx)
	if err != nil {
		return trace.SpanContext{}, err
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	o := Order{OrderID: orderID, CustomerID: "cust-" + orderID, Amount: "42.00", Card: Secret}
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3::numeric)`, o.OrderID, o.CustomerID, o.Amount); err != nil {
		return trace.SpanContext{}, err
	}
	payload, err := json.Marshal(o)
	if err != nil {
		return trace.SpanContext{}, err
	}
	msg := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), orderID)
	msg.Metadata.Set("event_type", "order.confirmed.v1")
	if err := e.Outbox.PublishInTx(ctx, tx, e.Orders, msg); err != nil {
		return trace.SpanContext{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return trace.SpanContext{}, err
	}
	return span.SpanContext(), nil
}

// StartForwarder runs a forwarder of both topics (a Sarama SyncProducer,
// tracing on e.TP) until the test ends; mod changes its config first.
func (e *Env) StartForwarder(t *testing.T, mod func(*outbox.ForwarderConfig)) *outbox.Forwarder {
	t.Helper()
	cfg := outbox.ForwarderConfig{DB: e.DB.Pool, Outbox: e.Outbox, PollInterval: 20 * time.Millisecond, TracerProvider: e.TP}
	if mod != nil {
		mod(&cfg)
	}
	if cfg.Producer == nil && cfg.Publisher == nil {
		producer, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: e.Broker.Addrs})
		must(t, err)
		t.Cleanup(func() { _ = producer.Close() })
		cfg.Producer = producer
	}
	fwd, err := outbox.NewForwarder(cfg, e.Logger)
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = fwd.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return fwd
}

// StartConsumer runs a router with one handler on topic (subscribed in
// group) behind the dedup middleware, until the test ends. The middleware
// traces on e.TP; dedupMod and subMod change the dedup and subscriber
// configs first. Messages the handler returns go to publishTopic through
// the outbox ([idem.Config.Outbox]).
func (e *Env) StartConsumer(t *testing.T, group, topic, publishTopic string, h message.HandlerFunc,
	dedupMod func(*idem.Config), subMod func(*kafka.SubscriberConfig),
) *idem.Dedup {
	t.Helper()
	cfg := idem.Config{DB: e.DB.Pool, ConsumerGroup: group, Table: e.Table, Outbox: e.Outbox, TracerProvider: e.TP}
	if dedupMod != nil {
		dedupMod(&cfg)
	}
	dedup, err := idem.NewDedup(cfg, e.Logger)
	must(t, err)
	sc, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: e.Broker.Addrs}, group)
	must(t, err)
	sc.NackResendSleep = 20 * time.Millisecond
	if subMod != nil {
		subMod(&sc)
	}
	sub, err := kafka.NewSubscriber(sc, e.Logger)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, e.Logger)
	must(t, err)
	router.AddHandler(group, topic, sub, publishTopic, refusingPublisher{}, h).AddMiddleware(dedup.Middleware)
	go func() { _ = router.Run(context.Background()) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()
	return dedup
}

// refusingPublisher is the router's publisher: with Config.Outbox set the
// middleware hands the router nothing to publish.
type refusingPublisher struct{}

func (refusingPublisher) Publish(string, ...*message.Message) error {
	return fmt.Errorf("otelchain: the router published: the outbox should have taken the messages")
}
func (refusingPublisher) Close() error { return nil }

// BillingHandler is billing's handler: decode the order, charge it at the
// provider (in a client span of its own, through the Idempotency-Key
// transport, which records the key on that span), INSERT the ledger row on
// the middleware's transaction, return billing.charged.v1.
func (e *Env) BillingHandler(tp trace.TracerProvider) message.HandlerFunc {
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(http.DefaultTransport, "charge"), Timeout: 10 * time.Second}
	tracer := tp.Tracer("billing")
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var o Order
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return nil, idem.Permanent(err)
		}
		cctx, span := tracer.Start(ctx, "POST /charges", trace.WithSpanKind(trace.SpanKindClient))
		req, err := http.NewRequestWithContext(cctx, http.MethodPost, e.Provider.URL+"/charges", strings.NewReader(string(msg.Payload)))
		if err != nil {
			span.End()
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			span.End()
			return nil, err
		}
		chargeID, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		span.End()
		if err != nil {
			return nil, err
		}
		eventID, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO ledger (order_id, charge_id, event_id) VALUES ($1, $2, $3)`, o.OrderID, string(chargeID), eventID); err != nil {
			return nil, err
		}
		out := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"`+o.OrderID+`","chargeId":"`+string(chargeID)+`"}`))
		out.Metadata.Set("event_type", "billing.charged.v1")
		publisher.WithPartitionKey(out, o.OrderID)
		return []*message.Message{out}, nil
	}
}

// NotificationHandler is the notification service's handler of
// billing.charged.v1: one notification row per order, on the middleware's
// transaction.
func NotificationHandler(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	var c struct {
		OrderID string `json:"orderId"`
	}
	if err := json.Unmarshal(msg.Payload, &c); err != nil {
		return nil, idem.Permanent(err)
	}
	eventID, _ := idem.EventIDFromContext(ctx)
	_, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO notifications (order_id, event_id) VALUES ($1, $2)`, c.OrderID, eventID)
	return nil, err
}

// Provider is a payment provider that dedups on the Idempotency-Key: a
// repeated key gets the first charge's id.
type Provider struct {
	URL      string
	mu       sync.Mutex
	charges  map[string]string // key → charge id
	requests int
}

// NewProvider starts the provider until the test ends.
func NewProvider(t *testing.T) *Provider {
	p := &Provider{charges: map[string]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idem.IdempotencyKeyHeader)
		if key == "" {
			http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		p.requests++
		id, ok := p.charges[key]
		if !ok {
			id = fmt.Sprintf("ch_%d", len(p.charges)+1)
			p.charges[key] = id
		}
		p.mu.Unlock()
		_, _ = io.WriteString(w, id)
	}))
	t.Cleanup(srv.Close)
	p.URL = srv.URL
	return p
}

// Keys returns the Idempotency-Keys charged.
func (p *Provider) Keys() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for k := range p.charges {
		out = append(out, k)
	}
	return out
}

// Requests counts the charge requests received.
func (p *Provider) Requests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.requests
}

// Records reads the first n records of partition 0 of topic, as a plain
// Sarama consumer sees them, headers included.
func (e *Env) Records(t *testing.T, topic string, n int) []*sarama.ConsumerMessage {
	t.Helper()
	c, err := sarama.NewConsumer(e.Broker.Addrs, idemkafka.SaramaConsumerConfig(nil))
	must(t, err)
	defer c.Close()
	pc, err := c.ConsumePartition(topic, 0, sarama.OffsetOldest)
	must(t, err)
	defer pc.Close()
	var out []*sarama.ConsumerMessage
	timeout := time.After(60 * time.Second)
	for len(out) < n {
		select {
		case m := <-pc.Messages():
			out = append(out, m)
		case <-timeout:
			t.Fatalf("otelchain: %d of %d records on %s", len(out), n, topic)
		}
	}
	return out
}

// Republish produces rec again, byte for byte (value, key, headers): a
// redelivery of the same event, as a forwarder resend would make.
func (e *Env) Republish(t *testing.T, rec *sarama.ConsumerMessage) {
	t.Helper()
	p, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: e.Broker.Addrs})
	must(t, err)
	defer p.Close()
	pm := &sarama.ProducerMessage{Topic: rec.Topic, Key: sarama.ByteEncoder(rec.Key), Value: sarama.ByteEncoder(rec.Value)}
	for _, h := range rec.Headers {
		pm.Headers = append(pm.Headers, *h)
	}
	_, _, err = p.SendMessage(pm)
	must(t, err)
}

// Header returns the value of rec's header key ("" when absent).
func Header(rec *sarama.ConsumerMessage, key string) string {
	for _, h := range rec.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

// Traceparent returns the W3C traceparent of sc (sampled).
func Traceparent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

// Named returns the spans named name, in the order they ended.
func Named(spans tracetest.SpanStubs, name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// ChildrenOf returns the spans whose parent is sc.
func ChildrenOf(spans tracetest.SpanStubs, sc trace.SpanContext) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Parent.SpanID() == sc.SpanID() && s.Parent.TraceID() == sc.TraceID() {
			out = append(out, s)
		}
	}
	return out
}

// Attr returns the value of attribute k of s (the zero Value when absent).
func Attr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// Linked reports whether s has a link to sc.
func Linked(s tracetest.SpanStub, sc trace.SpanContext) bool {
	for _, l := range s.Links {
		if l.SpanContext.TraceID() == sc.TraceID() && l.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

// idHeaders are the headers whose values are ids, which spans may record.
var idHeaders = map[string]bool{
	publisher.MetadataEventID: true, publisher.MetadataCausationID: true, publisher.MetadataCorrelationID: true,
	kafka.UUIDHeaderKey: true, "traceparent": true,
}

// AssertNothingLeaks fails t if any attribute of any span, span event or
// link carries payload bytes of the records, [Secret], or a header value
// other than the ids (event_id, causation_id, correlation_id, the Watermill
// message uuid, traceparent): partition key, occurred_at, event type,
// tracestate and baggage values included.
func AssertNothingLeaks(t testing.TB, spans tracetest.SpanStubs, records ...*sarama.ConsumerMessage) {
	t.Helper()
	forbidden := []string{Secret, BaggageMember}
	for _, r := range records {
		forbidden = append(forbidden, string(r.Value))
		for _, h := range r.Headers {
			if !idHeaders[string(h.Key)] && len(h.Value) > 0 {
				forbidden = append(forbidden, string(h.Value))
			}
		}
	}
	check := func(where string, kvs []attribute.KeyValue) {
		for _, kv := range kvs {
			v := kv.Value.String()
			for _, f := range forbidden {
				if strings.Contains(v, f) {
					t.Errorf("%s: attribute %s = %q carries %q (payload or a non-id header)", where, kv.Key, v, f)
				}
			}
		}
	}
	for _, s := range spans {
		check(s.Name, s.Attributes)
		for _, ev := range s.Events {
			check(s.Name+" event "+ev.Name, ev.Attributes)
		}
		for _, l := range s.Links {
			check(s.Name+" link", l.Attributes)
		}
	}
}

// Tree renders the spans of one trace as an indented tree: see
// [spantree.Tree] (the billing demo prints its trees with it too).
func Tree(spans tracetest.SpanStubs, traceID trace.TraceID) string {
	return spantree.Tree(spans, traceID)
}
