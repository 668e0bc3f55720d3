package bench

import (
	"context"
	"strconv"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// memSubscriber hands out n messages built in memory, as parRig.produce
// writes them (a UUIDv7 eventId, a partition key of parKeys), at most
// maxInFlight not yet acked or nacked (a nacked one is handed out again):
// the Kafka engines' ceiling, what the router, the middleware and
// PostgreSQL reach with no Kafka client at all. Each message is built
// before Subscribe returns, so the feed costs a channel send and an ack
// wait per message.
type memSubscriber struct {
	msgs        []*message.Message
	maxInFlight int
	once        sync.Once
	closing     chan struct{}
	wg          sync.WaitGroup
}

var _ message.Subscriber = (*memSubscriber)(nil)

func newMemSubscriber(n, maxInFlight int) *memSubscriber {
	s := &memSubscriber{msgs: make([]*message.Message, n), maxInFlight: maxInFlight, closing: make(chan struct{})}
	for i := range s.msgs {
		id := uuid.Must(uuid.NewV7()).String()
		msg := message.NewMessage(id, []byte(`{"amount":42}`))
		msg.Metadata.Set(publisher.MetadataEventID, id)
		s.msgs[i] = publisher.WithPartitionKey(msg, "key-"+strconv.Itoa(i%parKeys))
	}
	return s
}

// Subscribe hands out the messages once, whatever the topic.
func (s *memSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	s.wg.Go(func() {
		defer close(out)
		slots := make(chan struct{}, s.maxInFlight)
		redo := make(chan *message.Message, len(s.msgs)) // nacked: handed out again
		var waits sync.WaitGroup
		defer waits.Wait()
		next := 0
		for {
			var msg *message.Message
			select {
			case msg = <-redo:
			default:
				if next == len(s.msgs) {
					select {
					case msg = <-redo:
					case <-ctx.Done():
						return
					case <-s.closing:
						return
					}
				} else {
					msg = s.msgs[next]
					next++
				}
			}
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				return
			case <-s.closing:
				return
			}
			m := msg.Copy()
			m.SetContext(ctx)
			select {
			case out <- m:
			case <-ctx.Done():
				return
			case <-s.closing:
				return
			}
			waits.Go(func() {
				defer func() { <-slots }()
				select {
				case <-m.Acked():
				case <-m.Nacked():
					redo <- msg
				case <-ctx.Done():
				case <-s.closing:
				}
			})
		}
	})
	return out, nil
}

func (s *memSubscriber) Close() error {
	s.once.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}
