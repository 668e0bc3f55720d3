package idemtest_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
)

const fixtures = "testdata/contracts"

// orderConfirmedV1 is order.confirmed.v1 as published.
type orderConfirmedV1 struct {
	EventID     string `json:"eventId" validate:"required,uuid"`
	OrderID     string `json:"orderId" validate:"required"`
	CustomerID  string `json:"customerId" validate:"required"`
	TotalAmount string `json:"totalAmount" validate:"required,decimal=2"`
	Currency    string `json:"currency" validate:"required,iso4217"`
}

type money struct {
	Amount   string `json:"amount" validate:"required,decimal=2"`
	Currency string `json:"currency" validate:"required,iso4217"`
}

// orderConfirmedV2: the amount became an object, a required channel came.
type orderConfirmedV2 struct {
	EventID    string `json:"eventId" validate:"required,uuid"`
	OrderID    string `json:"orderId" validate:"required"`
	CustomerID string `json:"customerId" validate:"required"`
	Total      money  `json:"total" validate:"required"`
	Channel    string `json:"channel" validate:"required,oneof=web store"`
}

func declare[T any](t *testing.T, typ string) *contract.Contract[T] {
	t.Helper()
	c, err := contract.New[T](contract.Config{Type: typ})
	require.NoError(t, err)
	return c
}

func v2WithUpcast(t *testing.T) *contract.Contract[orderConfirmedV2] {
	v2 := declare[orderConfirmedV2](t, "order.confirmed.v2")
	require.NoError(t, contract.Upcast(v2, declare[orderConfirmedV1](t, "order.confirmed.v1"),
		func(o orderConfirmedV1) (orderConfirmedV2, error) {
			return orderConfirmedV2{EventID: o.EventID, OrderID: o.OrderID, CustomerID: o.CustomerID,
				Total: money{Amount: o.TotalAmount, Currency: o.Currency}, Channel: "web"}, nil
		}))
	return v2
}

func TestRequireCompatiblePasses(t *testing.T) {
	t.Parallel()
	v1 := declare[orderConfirmedV1](t, "order.confirmed.v1")
	idemtest.RequireCompatible(t, fixtures, v1, v1)

	// A new optional field: both directions hold.
	type withNote struct {
		orderConfirmedV1
		Note string `json:"note,omitempty" validate:"omitempty,max=200"`
	}
	idemtest.RequireCompatible(t, fixtures, declare[withNote](t, "order.confirmed.v1"), v1)

	// v2 reads the v1 fixtures through its upcaster.
	v2 := v2WithUpcast(t)
	idemtest.RequireCompatible(t, fixtures, v2, v2)
}

// Adding a required field to a published version breaks BACKWARD: the
// published payloads do not have it.
func TestRequireCompatibleCatchesANewRequiredField(t *testing.T) {
	t.Parallel()
	type withDiscount struct {
		orderConfirmedV1
		Discount string `json:"discount" validate:"required,decimal=2"`
	}
	next := declare[withDiscount](t, "order.confirmed.v1")
	msg := expectFatal(t, func(tb testing.TB) {
		idemtest.RequireCompatible(tb, fixtures, next, declare[orderConfirmedV1](t, "order.confirmed.v1"))
	})
	require.Contains(t, msg, "BACKWARD")
	require.Contains(t, msg, "order.confirmed.v1/full.json")
	require.Contains(t, msg, `field "discount" breaks rule required`)
}

// Dropping a field the published reader requires breaks FORWARD: the old
// consumers cannot read what the new producer writes.
func TestRequireCompatibleCatchesADroppedField(t *testing.T) {
	t.Parallel()
	type withoutCustomer struct {
		EventID     string `json:"eventId" validate:"required,uuid"`
		OrderID     string `json:"orderId" validate:"required"`
		TotalAmount string `json:"totalAmount" validate:"required,decimal=2"`
		Currency    string `json:"currency" validate:"required,iso4217"`
	}
	next := declare[withoutCustomer](t, "order.confirmed.v1")
	msg := expectFatal(t, func(tb testing.TB) {
		idemtest.RequireCompatible(tb, fixtures, next, declare[orderConfirmedV1](t, "order.confirmed.v1"))
	})
	require.Contains(t, msg, "FORWARD")
	require.Contains(t, msg, `field "customerId" breaks rule required`)

	// A retyped field: the published payloads no longer decode.
	type amountInCents struct {
		orderConfirmedV1
		TotalAmount int64 `json:"totalAmount" validate:"gt=0"`
	}
	msg = expectFatal(t, func(tb testing.TB) {
		idemtest.RequireCompatible(tb, fixtures, declare[amountInCents](t, "order.confirmed.v1"), declare[amountInCents](t, "order.confirmed.v1"))
	})
	require.Contains(t, msg, `BACKWARD`)
	require.Contains(t, msg, `field "totalAmount" breaks rule type`)
}

func TestRequireCompatibleRefusals(t *testing.T) {
	t.Parallel()
	// v2 without an upcaster cannot read the v1 payloads.
	v2 := declare[orderConfirmedV2](t, "order.confirmed.v2")
	msg := expectFatal(t, func(tb testing.TB) { idemtest.RequireCompatible(tb, fixtures, v2, v2) })
	require.Contains(t, msg, "BACKWARD")
	require.Contains(t, msg, "breaks rule version=order.confirmed.v1")

	// FORWARD is within one version.
	msg = expectFatal(t, func(tb testing.TB) {
		idemtest.RequireCompatible(tb, fixtures, v2WithUpcast(t), declare[orderConfirmedV1](t, "order.confirmed.v1"))
	})
	require.Contains(t, msg, "FORWARD compares two forms of one version")

	// A version with no golden payload yet.
	v3 := declare[orderConfirmedV2](t, "order.confirmed.v3")
	msg = expectFatal(t, func(tb testing.TB) { idemtest.RequireCompatible(tb, t.TempDir(), v3, v3) })
	require.Contains(t, msg, "no golden payload of order.confirmed.v3")
}
