package main

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/contract"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// Topics, event types and consumer groups of the example.
const (
	TopicOrdersConfirmed = "orders.confirmed"
	TopicBillingCharged  = "billing.charged"
	// TopicPoison receives the messages no redelivery can fix, with the
	// reason in the metadata (watermill's PoisonQueueWithFilter).
	TopicPoison = "orders.confirmed.poison"

	EventOrderConfirmed = "order.confirmed.v1"
	EventBillingCharged = "billing.charged.v1"

	GroupBilling      = "billing-order-confirmed"
	GroupNotification = "notification-order-confirmed"
)

// OrderConfirmed is the payload of order.confirmed.v1.
type OrderConfirmed struct {
	EventID       string    `json:"eventId" validate:"required,uuid"`
	EventType     string    `json:"eventType"`
	OccurredAt    time.Time `json:"occurredAt" validate:"required"`
	AggregateType string    `json:"aggregateType" validate:"eq=Order"`
	OrderID       string    `json:"orderId" validate:"required"`
	CustomerID    string    `json:"customerId" validate:"required"`
	TotalAmount   string    `json:"totalAmount" validate:"required,decimal=2,positive"` // decimal string, e.g. "129.90"
	Currency      string    `json:"currency" validate:"required,iso4217"`               // ISO 4217, e.g. "EUR"
}

// BillingCharged is the payload of billing.charged.v1.
type BillingCharged struct {
	EventID       string    `json:"eventId" validate:"required,uuid"`
	EventType     string    `json:"eventType"`
	OccurredAt    time.Time `json:"occurredAt" validate:"required"`
	AggregateType string    `json:"aggregateType" validate:"eq=Order"`
	OrderID       string    `json:"orderId" validate:"required"`
	ChargeID      string    `json:"chargeId" validate:"required"`
	Amount        string    `json:"amount" validate:"required,decimal=2,positive"`
	Currency      string    `json:"currency" validate:"required,iso4217"`
}

// orderConfirmedV1 is the contract of order.confirmed.v1: the checks are
// OrderConfirmed's validate tags; the partition key is the order id.
var orderConfirmedV1 = func() *contract.Contract[OrderConfirmed] {
	c, err := contract.New[OrderConfirmed](contract.Config{Type: EventOrderConfirmed, AggregateIDField: "orderId"})
	if err != nil {
		panic(err) // a declaration error, caught by any test
	}
	return c
}()

// billingChargedV1 is the contract of billing.charged.v1, which billing
// publishes through the outbox; its partition key is the order id too.
var billingChargedV1 = func() *contract.Contract[BillingCharged] {
	c, err := contract.New[BillingCharged](contract.Config{Type: EventBillingCharged, AggregateIDField: "orderId"})
	if err != nil {
		panic(err)
	}
	return c
}()

// decodeOrderConfirmed reads an order.confirmed.v1 message with its
// contract. Every failure is permanent (a *contract.Error, or a wrapped
// idem.ErrMalformedPayload): redelivering the same bytes cannot fix them,
// so the router sends the message to the poison topic instead of retrying
// forever. In a handler, the payload's eventId must also be the id the
// middleware claimed.
func decodeOrderConfirmed(msg *message.Message) (OrderConfirmed, error) {
	ev, err := orderConfirmedV1.Decode(msg)
	if err != nil {
		return ev, err
	}
	if id, ok := idem.EventIDFromContext(msg.Context()); ok {
		if p, err := uuid.Parse(ev.EventID); err != nil || p != id {
			return ev, fmt.Errorf("%w: payload eventId %q differs from the message's event id %s", idem.ErrMalformedPayload, ev.EventID, id)
		}
	}
	return ev, nil
}
