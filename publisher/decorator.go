package publisher

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// StampingPublisher stamps every message with [Stamp] (using the message's
// own context, so set it to the handler message's context to get a
// causation_id) before handing the batch to the next publisher. If any
// message cannot be stamped, nothing is published.
type StampingPublisher struct {
	next message.Publisher
}

var _ message.Publisher = (*StampingPublisher)(nil)

// NewStampingPublisher wraps next. Use it for publishers that write straight
// to the broker; the outbox stamps on its own.
func NewStampingPublisher(next message.Publisher) message.Publisher {
	return &StampingPublisher{next: next}
}

// Publish implements message.Publisher.
func (p *StampingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if _, err := Stamp(msg.Context(), msg); err != nil {
			return fmt.Errorf("stamp: %w", err)
		}
	}
	return p.next.Publish(topic, msgs...)
}

// Close closes the next publisher.
func (p *StampingPublisher) Close() error { return p.next.Close() }
