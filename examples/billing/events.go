package main

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"time"

	"github.com/google/uuid"

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
	EventID       string    `json:"eventId"`
	EventType     string    `json:"eventType"`
	OccurredAt    time.Time `json:"occurredAt"`
	AggregateType string    `json:"aggregateType"`
	OrderID       string    `json:"orderId"`
	CustomerID    string    `json:"customerId"`
	TotalAmount   string    `json:"totalAmount"` // decimal string, e.g. "129.90"
	Currency      string    `json:"currency"`    // ISO 4217, e.g. "EUR"
}

// BillingCharged is the payload of billing.charged.v1.
type BillingCharged struct {
	EventID       string    `json:"eventId"`
	EventType     string    `json:"eventType"`
	OccurredAt    time.Time `json:"occurredAt"`
	AggregateType string    `json:"aggregateType"`
	OrderID       string    `json:"orderId"`
	ChargeID      string    `json:"chargeId"`
	Amount        string    `json:"amount"`
	Currency      string    `json:"currency"`
}

var (
	amountRe   = regexp.MustCompile(`^[0-9]{1,10}(\.[0-9]{1,2})?$`)
	currencyRe = regexp.MustCompile(`^[A-Z]{3}$`)
)

// decodeOrderConfirmed parses and validates an order.confirmed.v1 payload.
// Every failure is permanent (wraps idem.ErrMalformedPayload): redelivering
// the same bytes cannot fix them, so the router sends the message to the
// poison topic instead of retrying forever. ctx is the handler's context; the
// payload's eventId must match the id the middleware claimed.
func decodeOrderConfirmed(ctx context.Context, payload []byte) (OrderConfirmed, error) {
	var ev OrderConfirmed
	if err := json.Unmarshal(payload, &ev); err != nil {
		return ev, malformed("not a JSON object: %v", err)
	}
	switch {
	case ev.EventType != EventOrderConfirmed:
		return ev, malformed("eventType %q, want %q", ev.EventType, EventOrderConfirmed)
	case ev.AggregateType != "Order":
		return ev, malformed("aggregateType %q, want \"Order\"", ev.AggregateType)
	case ev.OrderID == "":
		return ev, malformed("orderId missing")
	case ev.CustomerID == "":
		return ev, malformed("customerId missing")
	case !amountRe.MatchString(ev.TotalAmount) || isZeroAmount(ev.TotalAmount):
		return ev, malformed("totalAmount %q is not a positive decimal with at most 2 places", ev.TotalAmount)
	case !currencyRe.MatchString(ev.Currency):
		return ev, malformed("currency %q is not an ISO 4217 code", ev.Currency)
	case ev.OccurredAt.IsZero():
		return ev, malformed("occurredAt missing")
	}
	if id, ok := idem.EventIDFromContext(ctx); ok {
		if p, err := uuid.Parse(ev.EventID); err != nil || p != id {
			return ev, malformed("payload eventId %q differs from the message's event id %s", ev.EventID, id)
		}
	}
	return ev, nil
}

func isZeroAmount(s string) bool {
	for _, r := range s {
		if r != '0' && r != '.' {
			return false
		}
	}
	return true
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", idem.ErrMalformedPayload, fmt.Sprintf(format, args...))
}
