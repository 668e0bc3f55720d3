package contract_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// OrderConfirmed is the test event, order.confirmed.v1.
type OrderConfirmed struct {
	EventID     string    `json:"eventId" validate:"required,uuid"`
	EventType   string    `json:"eventType"`
	OccurredAt  time.Time `json:"occurredAt" validate:"required"`
	OrderID     string    `json:"orderId" validate:"required"`
	CustomerID  string    `json:"customerId" validate:"required"`
	TotalAmount string    `json:"totalAmount" validate:"required,decimal=2,positive"`
	Currency    string    `json:"currency" validate:"required,iso4217"`
	Items       []Item    `json:"items" validate:"required,min=1,dive"`
}

type Item struct {
	SKU      string `json:"sku" validate:"required"`
	Quantity int    `json:"quantity" validate:"gte=1,lte=1000"`
	// PriceMinor is money as an integer of minor units (cents).
	PriceMinor int64 `json:"priceMinor" validate:"gte=0"`
}

func newOrderConfirmed(t testing.TB) *contract.Contract[OrderConfirmed] {
	t.Helper()
	c, err := contract.New[OrderConfirmed](contract.Config{
		Type: "order.confirmed.v1", AggregateIDField: "orderId", MaxSize: 4096})
	require.NoError(t, err)
	return c
}

const goodPayload = `{"eventId":"0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f","eventType":"order.confirmed.v1",` +
	`"occurredAt":"2026-01-02T03:04:05Z","orderId":"o-1","customerId":"c-1",` +
	`"totalAmount":"129.90","currency":"EUR","items":[{"sku":"A-1","quantity":2,"priceMinor":6495}]}`

func msgOf(payload string, meta ...string) *message.Message {
	m := message.NewMessage("m", []byte(payload))
	for i := 0; i+1 < len(meta); i += 2 {
		m.Metadata.Set(meta[i], meta[i+1])
	}
	return m
}

// edit replaces old with new in goodPayload, once, failing if old is absent.
func edit(t *testing.T, old, new string) string {
	t.Helper()
	require.Contains(t, goodPayload, old)
	return strings.Replace(goodPayload, old, new, 1)
}

func TestDecodeAcceptsAGoodPayload(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	ev, err := c.Decode(msgOf(goodPayload))
	require.NoError(t, err)
	require.Equal(t, "o-1", ev.OrderID)
	require.Equal(t, "129.90", ev.TotalAmount)
	require.Equal(t, int64(6495), ev.Items[0].PriceMinor)
	require.Equal(t, "order.confirmed.v1", c.Type())
}

func TestDecodeAcceptsABOM(t *testing.T) {
	t.Parallel()
	ev, err := newOrderConfirmed(t).Decode(msgOf("\xef\xbb\xbf" + goodPayload))
	require.NoError(t, err)
	require.Equal(t, "o-1", ev.OrderID)
}

// A v1 reader reads a v1 payload from a newer producer that added fields
// (forward compatible), the type from the metadata alone as well.
func TestDecodeIgnoresUnknownFields(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	p := edit(t, `"currency":"EUR"`, `"currency":"EUR","discount":{"code":"X","amount":"5.00"},"channel":"web"`)
	ev, err := c.Decode(msgOf(p))
	require.NoError(t, err)
	require.Equal(t, "EUR", ev.Currency)

	p = edit(t, `"eventType":"order.confirmed.v1",`, ``)
	_, err = c.Decode(msgOf(p, "event_type", "order.confirmed.v1"))
	require.NoError(t, err)
}

// Each bad input is an *Error naming the field and the rule, and permanent.
func TestDecodeRefusesBadInput(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	cases := []struct {
		name        string
		payload     string
		meta        []string
		field, rule string
	}{
		{"missing field", edit(t, `"customerId":"c-1",`, ``), nil, "customerId", "required"},
		{"null for a required field", edit(t, `"customerId":"c-1"`, `"customerId":null`), nil, "customerId", "required"},
		{"wrong type", edit(t, `"orderId":"o-1"`, `"orderId":17`), nil, "orderId", "type"},
		{"wrong type in an array", edit(t, `"quantity":2`, `"quantity":"2"`), nil, "items.quantity", "type"},
		{"out of range number", edit(t, `"quantity":2`, `"quantity":1001`), nil, "items[0].quantity", "lte"},
		{"negative minor units", edit(t, `"priceMinor":6495`, `"priceMinor":-1`), nil, "items[0].priceMinor", "gte"},
		{"float for minor units", edit(t, `"priceMinor":6495`, `"priceMinor":64.95`), nil, "items.priceMinor", "type"},
		{"float where money is a decimal", edit(t, `"totalAmount":"129.90"`, `"totalAmount":129.90`), nil, "totalAmount", "type"},
		{"decimal with too many places", edit(t, `"totalAmount":"129.90"`, `"totalAmount":"129.901"`), nil, "totalAmount", "decimal"},
		{"decimal with an exponent", edit(t, `"totalAmount":"129.90"`, `"totalAmount":"1e3"`), nil, "totalAmount", "decimal"},
		{"zero amount", edit(t, `"totalAmount":"129.90"`, `"totalAmount":"0.00"`), nil, "totalAmount", "positive"},
		{"negative amount", edit(t, `"totalAmount":"129.90"`, `"totalAmount":"-1"`), nil, "totalAmount", "positive"},
		{"currency not 3 letters", edit(t, `"currency":"EUR"`, `"currency":"EURO"`), nil, "currency", "iso4217"},
		{"currency not ISO 4217", edit(t, `"currency":"EUR"`, `"currency":"eur"`), nil, "currency", "iso4217"},
		{"empty array", edit(t, `[{"sku":"A-1","quantity":2,"priceMinor":6495}]`, `[]`), nil, "items", "min"},
		{"wrong event type", edit(t, `"order.confirmed.v1"`, `"order.shipped.v1"`), nil, "eventType", "event_type"},
		{"malformed event type", edit(t, `"order.confirmed.v1"`, `"OrderConfirmed"`), nil, "eventType", "event_type"},
		{"unknown version", edit(t, `"order.confirmed.v1"`, `"order.confirmed.v2"`), nil, "eventType", "version"},
		{"no event type", edit(t, `"eventType":"order.confirmed.v1",`, ``), nil, "eventType", "event_type"},
		{"metadata and payload disagree", goodPayload, []string{"event_type", "order.shipped.v1"}, "eventType", "event_type"},
		{"wrong type in the metadata", edit(t, `"eventType":"order.confirmed.v1",`, ``), []string{"event_type", "order.shipped.v1"}, "eventType", "event_type"},
		{"duplicate key", edit(t, `"currency":"EUR"`, `"currency":"EUR","currency":"USD"`), nil, "currency", "duplicate_key"},
		{"duplicate key differing in case", edit(t, `"currency":"EUR"`, `"currency":"EUR","Currency":"USD"`), nil, "Currency", "duplicate_key"},
		{"nested duplicate key", edit(t, `"sku":"A-1"`, `"sku":"A-1","sku":"B-2"`), nil, "items[0].sku", "duplicate_key"},
		{"over the max size", edit(t, `"customerId":"c-1"`, `"customerId":"c-1","pad":"`+strings.Repeat("x", 4096)+`"`), nil, "", "max_size"},
		{"not JSON", `{"eventType":`, nil, "", "json"},
		{"not an object", `[1,2]`, nil, "", "json"},
		{"trailing data", goodPayload + `{}`, nil, "", "json"},
		{"empty", ``, nil, "", "json"},
		{"bad time", edit(t, `"2026-01-02T03:04:05Z"`, `"yesterday"`), nil, "", "type"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := c.Decode(msgOf(tc.payload, tc.meta...))
			require.Error(t, err)
			var ce *contract.Error
			require.ErrorAs(t, err, &ce, "%v", err)
			require.Equal(t, tc.rule, ce.Rule, "%v", err)
			require.Equal(t, tc.field, ce.Field, "%v", err)
			require.Equal(t, "order.confirmed.v1", ce.Type)
			require.True(t, idem.IsPermanent(err), "not permanent: %v", err)
			require.ErrorIs(t, err, idem.ErrMalformedPayload)
			require.Contains(t, err.Error(), "breaks rule "+tc.rule)
		})
	}
}

// The error text names the rule's parameter and never the offending value.
func TestErrorText(t *testing.T) {
	t.Parallel()
	_, err := newOrderConfirmed(t).Decode(msgOf(edit(t, `"quantity":2`, `"quantity":987654`)))
	require.EqualError(t, err, `contract order.confirmed.v1: field "items[0].quantity" breaks rule lte=1000`)
	_, err = newOrderConfirmed(t).Decode(msgOf(edit(t, `"currency":"EUR"`, `"currency":"SECRET"`)))
	require.NotContains(t, err.Error(), "SECRET")
}

func TestNewRefusesBadDeclarations(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"", "order.confirmed", "order.confirmed.v0", "order.confirmed.v01", "Order.v1", ".v1", "order.confirmed.vX"} {
		_, err := contract.New[OrderConfirmed](contract.Config{Type: typ})
		require.Error(t, err, typ)
	}
	_, err := contract.New[string](contract.Config{Type: "a.v1"})
	require.ErrorContains(t, err, "not a struct")
	_, err = contract.New[OrderConfirmed](contract.Config{Type: "a.v1", AggregateIDField: "order_id"})
	require.ErrorContains(t, err, "AggregateIDField")
	type badTag struct {
		A string `json:"a" validate:"required,nosuchrule"`
	}
	_, err = contract.New[badTag](contract.Config{Type: "a.v1"})
	require.ErrorContains(t, err, "nosuchrule")
	_, err = contract.New[OrderConfirmed](contract.Config{Type: "a.v1", MaxSize: -1})
	require.ErrorContains(t, err, "MaxSize")
}

// Decode never panics, whatever the bytes (a seed corpus; run longer with
// go test -fuzz FuzzDecode ./contract).
func FuzzDecode(f *testing.F) {
	f.Add([]byte(goodPayload))
	f.Add([]byte(`{"items":[{"sku":{"a":[1,{"b":null}]}}]}`))
	f.Add([]byte("\xef\xbb\xbf{}"))
	f.Add([]byte(`{"eventType":"order.confirmed.v99999999999"}`))
	c := newOrderConfirmed(f)
	f.Fuzz(func(t *testing.T, payload []byte) {
		_, err := c.Decode(msgOf(string(payload)))
		if err != nil && !idem.IsPermanent(err) {
			t.Fatalf("not permanent: %v", err)
		}
	})
}

func TestMessage(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	ctx := context.Background()
	ev := OrderConfirmed{OccurredAt: time.Now().UTC(), OrderID: "o-7", CustomerID: "c-1",
		TotalAmount: "10.00", Currency: "EUR", Items: []Item{{SKU: "A", Quantity: 1}}}
	msg, err := c.Message(ctx, ev)
	require.NoError(t, err)
	id := msg.Metadata.Get(publisher.MetadataEventID)
	require.Equal(t, id, msg.UUID)
	require.Equal(t, "order.confirmed.v1", msg.Metadata.Get("event_type"))
	require.Equal(t, "o-7", msg.Metadata.Get(publisher.MetadataPartitionKey))
	require.NotEmpty(t, msg.Metadata.Get(publisher.MetadataOccurredAt))
	got, err := c.Decode(msg)
	require.NoError(t, err)
	require.Equal(t, id, got.EventID, "the payload carries the event id too")
	require.Equal(t, "order.confirmed.v1", got.EventType)
	pid, err := publisher.EventIDFromMessage(msg)
	require.NoError(t, err)
	require.Equal(t, id, pid.String())

	// The event's own id is kept; the same event published twice is one event.
	ev.EventID = id
	again, err := c.Message(ctx, ev)
	require.NoError(t, err)
	require.Equal(t, id, again.Metadata.Get(publisher.MetadataEventID))

	// What the consumer would refuse never reaches a topic.
	bad := ev
	bad.Currency = "EURO"
	_, err = c.Message(ctx, bad)
	var ce *contract.Error
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "currency", ce.Field)
	bad = ev
	bad.OrderID = ""
	_, err = c.Message(ctx, bad)
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "orderId", ce.Field)
	bad = ev
	bad.EventType = "order.shipped.v1"
	_, err = c.Message(ctx, bad)
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "event_type", ce.Rule)
	bad = ev
	bad.EventID = "0190f5a8-7b2c-4cc0-8f00-3a4b5c6d7e8f" // a v4
	_, err = c.Message(ctx, bad)
	require.True(t, errors.Is(err, publisher.ErrNotUUIDv7), "%v", err)
}

// The fields of an embedded struct are named as JSON names them: flat.
func TestErrorFieldOfAnEmbeddedStruct(t *testing.T) {
	t.Parallel()
	type withDiscount struct {
		OrderConfirmed
		Discount string `json:"discount" validate:"required,decimal=2"`
	}
	c, err := contract.New[withDiscount](contract.Config{Type: "order.confirmed.v1"})
	require.NoError(t, err)
	_, err = c.Decode(msgOf(edit(t, `"currency":"EUR"`, `"currency":"EURO"`)))
	var ce *contract.Error
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "currency", ce.Field)
	require.Equal(t, "and 1 more", ce.Detail, "discount is missing too")
}
