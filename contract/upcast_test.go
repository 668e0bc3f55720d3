package contract_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// OrderConfirmedV2 is a breaking change of v1: the amount becomes a Money
// object, and a required channel is added.
type OrderConfirmedV2 struct {
	EventID   string `json:"eventId" validate:"required,uuid"`
	EventType string `json:"eventType"`
	OrderID   string `json:"orderId" validate:"required"`
	Total     Money  `json:"total" validate:"required"`
	Channel   string `json:"channel" validate:"required,oneof=web store phone"`
}

type Money struct {
	Amount   string `json:"amount" validate:"required,decimal=2"`
	Currency string `json:"currency" validate:"required,iso4217"`
}

func upV1(v1 OrderConfirmed) (OrderConfirmedV2, error) {
	return OrderConfirmedV2{EventID: v1.EventID, EventType: "order.confirmed.v2", OrderID: v1.OrderID,
		Total: Money{Amount: v1.TotalAmount, Currency: v1.Currency}, Channel: "web"}, nil
}

func newV2(t *testing.T) *contract.Contract[OrderConfirmedV2] {
	t.Helper()
	v2, err := contract.New[OrderConfirmedV2](contract.Config{Type: "order.confirmed.v2", AggregateIDField: "orderId"})
	require.NoError(t, err)
	require.NoError(t, contract.Upcast(v2, newOrderConfirmed(t), upV1))
	return v2
}

const v2Payload = `{"eventId":"0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f","eventType":"order.confirmed.v2",` +
	`"orderId":"o-2","total":{"amount":"5.00","currency":"USD"},"channel":"store"}`

// One handler, one type, both versions on the topic.
func TestUpcastReadsBothVersions(t *testing.T) {
	t.Parallel()
	v2 := newV2(t)
	got, err := v2.Decode(msgOf(goodPayload))
	require.NoError(t, err)
	require.Equal(t, OrderConfirmedV2{EventID: "0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f", EventType: "order.confirmed.v2",
		OrderID: "o-1", Total: Money{Amount: "129.90", Currency: "EUR"}, Channel: "web"}, got)

	got, err = v2.Decode(msgOf(v2Payload))
	require.NoError(t, err)
	require.Equal(t, "store", got.Channel)

	// The type from the metadata alone selects the version too.
	_, err = v2.Decode(msgOf(edit(t, `"eventType":"order.confirmed.v1",`, ``), "event_type", "order.confirmed.v1"))
	require.NoError(t, err)
}

func TestUpcastRefusals(t *testing.T) {
	t.Parallel()
	v2 := newV2(t)
	var ce *contract.Error

	// A v1 event that breaks v1's own rules is refused by them.
	_, err := v2.Decode(msgOf(edit(t, `"currency":"EUR"`, `"currency":"EURO"`)))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "order.confirmed.v1", ce.Type)
	require.Equal(t, "currency", ce.Field)
	require.True(t, idem.IsPermanent(err))

	// A v1 reader does not read v2; a v2 reader does not read v3.
	_, err = newOrderConfirmed(t).Decode(msgOf(v2Payload))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "version", ce.Rule)
	require.EqualError(t, err, `contract order.confirmed.v1: field "eventType" breaks rule version=order.confirmed.v2: this reader reads v1`)
	_, err = v2.Decode(msgOf(v2Payload, "event_type", "order.confirmed.v3"))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "event_type", ce.Rule, "metadata and payload disagree")
	_, err = v2.Decode(msgOf(edit(t, `"order.confirmed.v1"`, `"order.confirmed.v3"`)))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "version", ce.Rule)
	require.Contains(t, err.Error(), "this reader reads v1, v2")

	// An upcaster's error, and an upcast result that breaks v2's rules.
	v2b, err := contract.New[OrderConfirmedV2](contract.Config{Type: "order.confirmed.v2"})
	require.NoError(t, err)
	require.NoError(t, contract.Upcast(v2b, newOrderConfirmed(t), func(v1 OrderConfirmed) (OrderConfirmedV2, error) {
		if v1.CustomerID == "c-1" {
			return OrderConfirmedV2{}, errors.New("customer c-1 has no channel")
		}
		v2, _ := upV1(v1)
		v2.Channel = "fax"
		return v2, nil
	}))
	_, err = v2b.Decode(msgOf(goodPayload))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "upcast", ce.Rule)
	require.Equal(t, "order.confirmed.v1", ce.Param)
	require.True(t, idem.IsPermanent(err))
	_, err = v2b.Decode(msgOf(edit(t, `"customerId":"c-1"`, `"customerId":"c-2"`)))
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "order.confirmed.v2", ce.Type)
	require.Equal(t, "channel", ce.Field)
	require.Equal(t, "oneof", ce.Rule)
}

// v3 upcasts from v2, which upcasts from v1: v3 reads all three.
func TestUpcastChains(t *testing.T) {
	t.Parallel()
	type OrderConfirmedV3 struct {
		OrderV2 OrderConfirmedV2 `json:"order" validate:"required"`
	}
	v3, err := contract.New[OrderConfirmedV3](contract.Config{Type: "order.confirmed.v3"})
	require.NoError(t, err)
	require.NoError(t, contract.Upcast(v3, newV2(t), func(v2 OrderConfirmedV2) (OrderConfirmedV3, error) {
		return OrderConfirmedV3{OrderV2: v2}, nil
	}))
	got, err := v3.Decode(msgOf(goodPayload))
	require.NoError(t, err)
	require.Equal(t, "129.90", got.OrderV2.Total.Amount)
	got, err = v3.Decode(msgOf(v2Payload))
	require.NoError(t, err)
	require.Equal(t, "store", got.OrderV2.Channel)
}

func TestUpcastDeclarationErrors(t *testing.T) {
	t.Parallel()
	v1 := newOrderConfirmed(t)
	v2 := newV2(t)
	require.ErrorContains(t, contract.Upcast(v2, v1, upV1), "already reads")
	down := func(v2 OrderConfirmedV2) (OrderConfirmed, error) { return OrderConfirmed{}, nil }
	require.ErrorContains(t, contract.Upcast(v1, v2, down), "not an older version")
	other, err := contract.New[OrderConfirmed](contract.Config{Type: "order.shipped.v2"})
	require.NoError(t, err)
	same := func(v1 OrderConfirmed) (OrderConfirmed, error) { return v1, nil }
	require.ErrorContains(t, contract.Upcast(other, v1, same), "not an older version")
}
