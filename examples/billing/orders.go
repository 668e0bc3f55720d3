package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// schemaSQL creates the business tables of the three services. None of them
// has a UNIQUE constraint on order_id on purpose: the demo checks that the
// dedup middleware alone keeps one row per order.
const schemaSQL = `
CREATE TABLE orders (
	id           text PRIMARY KEY,
	customer_id  text NOT NULL,
	total_amount numeric(12,2) NOT NULL,
	currency     char(3) NOT NULL,
	status       text NOT NULL,
	event_id     uuid NOT NULL,
	confirmed_at timestamptz NOT NULL
);
CREATE TABLE ledger (
	id          bigserial PRIMARY KEY,
	order_id    text NOT NULL,
	customer_id text NOT NULL,
	amount      numeric(12,2) NOT NULL,
	currency    char(3) NOT NULL,
	charge_id   text NOT NULL,
	event_id    uuid NOT NULL,
	created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE notifications (
	id          bigserial PRIMARY KEY,
	order_id    text NOT NULL,
	customer_id text NOT NULL,
	kind        text NOT NULL,
	event_id    uuid NOT NULL,
	created_at  timestamptz NOT NULL DEFAULT now()
);`

// Order is an order about to be confirmed.
type Order struct {
	ID          string
	CustomerID  string
	TotalAmount string
	Currency    string
}

// OrderService confirms orders: the orders row and the order.confirmed.v1
// event commit in one transaction (the outbox), so there is never an order
// without its event or an event without its order.
type OrderService struct {
	DB     *pgxpool.Pool
	Outbox idem.OutboxWriter
	// Topic the event is written for: an outbox topic (its tables must be
	// migrated). Defaults to TopicOrdersConfirmed.
	Topic string
	// TracerProvider traces Confirm: the business transaction is a span,
	// "confirm order", the root of the order's trace, and the outbox row
	// stores its context, so the event's consumers continue that trace.
	// Defaults to nil: the global provider (no span while no SDK is
	// installed there).
	TracerProvider trace.TracerProvider
}

// OrderServiceTracer is the instrumentation name of the order service's span.
const OrderServiceTracer = "order-service"

// Confirm stores the order and writes its event to the outbox. It returns the
// event message (as written) so the demo can re-publish copies of it.
func (s *OrderService) Confirm(ctx context.Context, o Order) (_ *message.Message, err error) {
	tp := s.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	ctx, span := tp.Tracer(OrderServiceTracer).Start(ctx, "confirm order", trace.WithSpanKind(trace.SpanKindServer))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()

	eventID := publisher.NewEventID()
	now := time.Now().UTC()
	// The contract checks the event, puts the event id and type in payload
	// and metadata, and the order id in partition_key (the Kafka key: one
	// partition per order, in order).
	msg, err := orderConfirmedV1.Message(ctx, OrderConfirmed{
		EventID:       eventID.String(),
		OccurredAt:    now,
		AggregateType: "Order",
		OrderID:       o.ID,
		CustomerID:    o.CustomerID,
		TotalAmount:   o.TotalAmount,
		Currency:      o.Currency,
	})
	if err != nil {
		return nil, fmt.Errorf("confirm order %s: %w", o.ID, err)
	}
	msg.Metadata.Set(publisher.MetadataOccurredAt, now.Format(time.RFC3339Nano))

	tx, err := s.DB.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("confirm order %s: begin: %w", o.ID, err)
	}
	// After Commit the rollback is a no-op returning pgx.ErrTxClosed.
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx,
		`INSERT INTO orders (id, customer_id, total_amount, currency, status, event_id, confirmed_at)
		 VALUES ($1, $2, $3::numeric, $4, 'confirmed', $5, $6)`,
		o.ID, o.CustomerID, o.TotalAmount, o.Currency, eventID, now); err != nil {
		return nil, fmt.Errorf("confirm order %s: %w", o.ID, err)
	}
	topic := s.Topic
	if topic == "" {
		topic = TopicOrdersConfirmed
	}
	// The row stores ctx's trace context (traceparent), the span above.
	if err := s.Outbox.PublishInTx(ctx, tx, topic, msg); err != nil {
		return nil, fmt.Errorf("confirm order %s: outbox: %w", o.ID, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("confirm order %s: commit: %w", o.ID, err)
	}
	return msg, nil
}
