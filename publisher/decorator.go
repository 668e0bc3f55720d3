package publisher

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// NewStampingPublisher wraps next so that every message is stamped with
// [Stamp] (using the message's own context, so set it to the handler
// message's context to get a causation_id) before the batch is handed to
// next. If any message cannot be stamped, nothing is published. Use it for
// publishers that write straight to the broker; the outbox stamps on its
// own. Close closes next.
func NewStampingPublisher(next message.Publisher) message.Publisher {
	return &stampingPublisher{next: next}
}

type stampingPublisher struct {
	next message.Publisher
}

var _ message.Publisher = (*stampingPublisher)(nil)

func (p *stampingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if _, err := Stamp(msg.Context(), msg); err != nil {
			return fmt.Errorf("stamp: %w", err)
		}
	}
	return p.next.Publish(topic, msgs...)
}

func (p *stampingPublisher) Close() error { return p.next.Close() }
