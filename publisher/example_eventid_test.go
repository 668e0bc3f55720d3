package publisher_test

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// A header and a payload id that disagree: EventIDFromMessage (the dedup
// middleware's default EventIDFunc) refuses the message with a permanent
// error, for the poison queue; EventIDFromMetadata lets the header win,
// with or without the payload as the fallback.
func ExampleEventIDFromMetadata() {
	const header = "01960000-0000-7000-8000-000000000001"
	const inPayload = "01960000-0000-7000-8000-000000000002"
	msg := message.NewMessage("m-1", []byte(`{"eventId":"`+inPayload+`","amount":5}`))
	msg.Metadata.Set(publisher.MetadataEventID, header)

	_, err := publisher.EventIDFromMessage(msg)
	var e *publisher.EventIDError
	fmt.Println("default refuses:", errors.Is(err, publisher.ErrEventIDMismatch), errors.As(err, &e) && e.Source == "payload")

	id, err := publisher.EventIDFromMetadata(true)(msg)
	fmt.Println("metadata first:", id, err)

	// Without the payload fallback, a message without the header has no id.
	_, err = publisher.EventIDFromMetadata(false)(message.NewMessage("m-2", []byte(`{"eventId":"`+inPayload+`"}`)))
	fmt.Println("metadata only, no header:", errors.Is(err, publisher.ErrMissingEventID))
	// Output:
	// default refuses: true true
	// metadata first: 01960000-0000-7000-8000-000000000001 <nil>
	// metadata only, no header: true
}
