package contract_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/contract"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// PaymentRequested is an event struct: JSON names, validator tags, money as
// a decimal string.
type PaymentRequested struct {
	EventID  string `json:"eventId" validate:"required,uuid"`
	OrderID  string `json:"orderId" validate:"required"`
	Amount   string `json:"amount" validate:"required,decimal=2"`
	Currency string `json:"currency" validate:"required,iso4217"`
}

// Declare a contract, build a message with it on the producer side, decode
// it on the consumer side, and see a refusal.
func ExampleNew() {
	paymentRequested, err := contract.New[PaymentRequested](contract.Config{
		Type: "payment.requested.v1", AggregateIDField: "orderId"})
	if err != nil {
		panic(err)
	}

	// Producer: hand msg to the outbox's publisher (or any publisher).
	msg, err := paymentRequested.Message(context.Background(),
		PaymentRequested{OrderID: "o-1", Amount: "129.90", Currency: "EUR"})
	if err != nil {
		panic(err)
	}
	fmt.Println(msg.Metadata.Get("event_type"), msg.Metadata.Get("partition_key"))

	// Consumer, in the handler.
	ev, err := paymentRequested.Decode(msg)
	fmt.Println(ev.Amount, ev.Currency, ev.EventID == msg.Metadata.Get("event_id"), err)

	// A float where money must be a decimal string: permanent, poison queue.
	bad := message.NewMessage("m", []byte(`{"eventType":"payment.requested.v1",`+
		`"eventId":"0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f","orderId":"o-1","amount":129.9,"currency":"EUR"}`))
	_, err = paymentRequested.Decode(bad)
	var ce *contract.Error
	fmt.Println(errors.As(err, &ce), ce.Field, ce.Rule, idem.IsPermanent(err))
	fmt.Println(err)
	// Output:
	// payment.requested.v1 o-1
	// 129.90 EUR true <nil>
	// true amount type true
	// contract payment.requested.v1: field "amount" breaks rule type: a JSON number where the contract declares string
}
