package contract_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// BillingCharged is the follow-up event, billing.charged.v1; it carries no
// eventType field of its own: Message writes it.
type BillingCharged struct {
	EventID  string `json:"eventId" validate:"required,uuid"`
	OrderID  string `json:"orderId" validate:"required"`
	Amount   string `json:"amount" validate:"required,decimal=2"`
	Currency string `json:"currency" validate:"required,iso4217"`
}

// A handler behind the dedup middleware decodes its typed event and
// publishes a typed follow-up through the outbox, in the message's
// transaction, under redelivery: one outbox row, with the event id in its
// payload and metadata, the event type, the aggregate's partition key and
// the causation id.
func TestTypedEventThroughTheOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 10)
	table := deduplicator.TableConfig{Schema: db.Schema}
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"billing.charged"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table), outbox.MigrationLine(ob.Config(), "billing.charged")))
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)

	orderConfirmed := newOrderConfirmed(t)
	billingCharged, err := contract.New[BillingCharged](contract.Config{Type: "billing.charged.v1", AggregateIDField: "orderId"})
	require.NoError(t, err)

	handler := func(msg *message.Message) ([]*message.Message, error) {
		ev, err := orderConfirmed.Decode(msg)
		if err != nil {
			return nil, err
		}
		out, err := billingCharged.Message(msg.Context(), BillingCharged{OrderID: ev.OrderID, Amount: ev.TotalAmount, Currency: ev.Currency})
		if err != nil {
			return nil, err
		}
		pub, err := ob.PublisherFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		return nil, pub.Publish("billing.charged", out)
	}
	in, err := orderConfirmed.Message(ctx, OrderConfirmed{OccurredAt: time.Now().UTC(), OrderID: "o-9", CustomerID: "c-1",
		TotalAmount: "12.30", Currency: "EUR", Items: []Item{{SKU: "A", Quantity: 1, PriceMinor: 1230}}})
	require.NoError(t, err)
	res := idemtest.RunWithRedelivery(ctx, t, dedup, handler, in, &idemtest.RedeliveryOpts{Deliveries: 3, RollbackFirst: true})
	idemtest.RequireProcessed(ctx, t, db.Pool, table, "billing", res.EventID)

	got := idemtest.RequireOutboxMessage(ctx, t, db.Pool, ob, "billing.charged", &idemtest.RequireOutboxOpts{
		CausationID: res.EventID, Count: 1,
		Metadata: map[string]string{"event_type": "billing.charged.v1", publisher.MetadataPartitionKey: "o-9"}})
	ev, err := billingCharged.Decode(got[0])
	require.NoError(t, err)
	require.Equal(t, BillingCharged{EventID: got[0].Metadata.Get(publisher.MetadataEventID), OrderID: "o-9", Amount: "12.30", Currency: "EUR"}, ev)
	var raw map[string]any
	require.NoError(t, json.Unmarshal(got[0].Payload, &raw))
	require.Equal(t, "billing.charged.v1", raw["eventType"], "the payload carries the type too")
}
