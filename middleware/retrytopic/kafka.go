package retrytopic

import (
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/internal/handlertracer"
)

// HoldingTracer wraps next (nil for none; kafka.NewOTELSaramaTracer() for
// OpenTelemetry) so that the consumer-group handler of a watermill-kafka
// subscriber holds each record of a partition until its [MetadataNotBefore]
// time, before handing it to watermill. It uses watermill-kafka's
// SubscriberConfig.Tracer hook, the one place where a subscriber exposes
// Sarama's group session.
//
// Why not only wait in the handler ([RetryTopic.Middleware] does that too,
// for any subscriber): watermill-kafka keeps one message in flight per
// partition and runs partitions concurrently, so a handler that sleeps
// blocks only its partition, but the message context does not end when
// the group rebalances, and Sarama waits for every partition's handler
// before it rejoins. A long sleep then stalls the whole group's rebalance up
// to Consumer.Group.Rebalance.Timeout. The held record here is dropped as
// soon as the session ends (it was neither delivered nor marked, so its new
// owner reads it again), and the rebalance goes on.
func HoldingTracer(next kafka.SaramaTracer) kafka.SaramaTracer {
	return handlertracer.New(next, func(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
		return holdingHandler{ConsumerGroupHandler: h}
	})
}

type holdingHandler struct{ sarama.ConsumerGroupHandler }

// ConsumeClaim feeds the wrapped handler from a goroutine that holds each
// record until its not-before time; the goroutine stops when the session
// ends or the wrapped handler returns.
func (h holdingHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	out := make(chan *sarama.ConsumerMessage)
	stop := make(chan struct{})
	done := make(chan struct{})
	sessDone := sess.Context().Done()
	go func() {
		defer close(done)
		defer close(out)
		for {
			var m *sarama.ConsumerMessage
			var ok bool
			select {
			case m, ok = <-claim.Messages():
				if !ok {
					return
				}
			case <-stop:
				return
			case <-sessDone:
				return
			}
			if d := time.Until(RecordNotBefore(m)); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-stop:
					t.Stop()
					return
				case <-sessDone:
					t.Stop()
					return
				}
			}
			select {
			case out <- m:
			case <-stop:
				return
			case <-sessDone:
				return
			}
		}
	}()
	err := h.ConsumerGroupHandler.ConsumeClaim(sess, heldClaim{ConsumerGroupClaim: claim, msgs: out})
	close(stop)
	<-done
	return err
}

type heldClaim struct {
	sarama.ConsumerGroupClaim
	msgs <-chan *sarama.ConsumerMessage
}

func (c heldClaim) Messages() <-chan *sarama.ConsumerMessage { return c.msgs }

// RecordNotBefore reads the [MetadataNotBefore] header of a record (zero if
// none). Set it as parallel.SubscriberConfig.NotBeforeFunc of a retry
// topic's parallel subscriber: a copy then waits in its partition's window,
// holding only the later copies of its key, and a rebalance drops the wait.
func RecordNotBefore(m *sarama.ConsumerMessage) time.Time {
	for _, h := range m.Headers {
		if h != nil && string(h.Key) == MetadataNotBefore {
			t, err := time.Parse(time.RFC3339Nano, string(h.Value))
			if err == nil {
				return t
			}
		}
	}
	return time.Time{}
}
