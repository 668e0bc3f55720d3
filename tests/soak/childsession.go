package soak

import (
	"slices"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/internal/handlertracer"
)

// session records that subscriber i's consumer group has set up a session
// (its first JoinGroup and SyncGroup are done), and reports when every
// consumer group of the process has.
func (c *child) session(i int) {
	c.sessMu.Lock()
	defer c.sessMu.Unlock()
	if c.joined[i] {
		return
	}
	c.joined[i] = true
	if !slices.Contains(c.joined, false) {
		c.allJoined.Store(true)
		c.emit(lineJoined)
	}
}

// sessionTracer wraps a subscriber's tracer (nil, or the retry topics'
// HoldingTracer) to see its consumer group's first session start. The
// soak's faults kill a process only once each of its three consumer groups
// has completed its first join: kfake never expires a member killed while
// its first JoinGroup is pending, and the group then stalls until a
// rebalance times out (docs/soak.md, "The consumer-group livelock"). With
// one group per process, "has consumed a message" was enough to tell; with
// three, a process consumes its main topic while a retry group's first
// join may still be pending. Killing a member during that join is the
// crash-loop fault's business.
func sessionTracer(next kafka.SaramaTracer, c *child, i int) kafka.SaramaTracer {
	return handlertracer.New(next, func(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
		return sessionHandler{ConsumerGroupHandler: h, c: c, i: i}
	})
}

type sessionHandler struct {
	sarama.ConsumerGroupHandler
	c *child
	i int
}

func (h sessionHandler) Setup(s sarama.ConsumerGroupSession) error {
	err := h.ConsumerGroupHandler.Setup(s)
	if err == nil {
		h.c.session(h.i)
	}
	return err
}
