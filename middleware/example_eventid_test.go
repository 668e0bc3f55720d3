package middleware_test

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// A header and a payload id that disagree: the default refuses the message
// (a permanent error, for the poison queue); HeaderFirstEventIDFunc lets the
// header win.
func ExampleHeaderFirstEventIDFunc() {
	const header = "01960000-0000-7000-8000-000000000001"
	const inPayload = "01960000-0000-7000-8000-000000000002"
	msg := message.NewMessage("m-1", []byte(`{"eventId":"`+inPayload+`","amount":5}`))
	msg.Metadata.Set("event_id", header)

	_, err := idem.DefaultEventIDFunc(msg)
	fmt.Println("default refuses:", errors.Is(err, idem.ErrEventIDMismatch), idem.IsPermanent(err))

	id, err := idem.HeaderFirstEventIDFunc(msg)
	fmt.Println("header first:", id, err)
	// Output:
	// default refuses: true true
	// header first: 01960000-0000-7000-8000-000000000001 <nil>
}
