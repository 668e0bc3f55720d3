package idemkafka

import (
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/internal/claimstart"
	"github.com/idemkit/watermill-idempotency/internal/handlertracer"
)

// revokeBound returns a tracer (wrapping next, nil for none) whose
// consumer-group handler bounds how long a watermill-kafka subscriber keeps
// a partition after its group session ended (a rebalance, a Close).
//
// watermill-kafka's ConsumeClaim hands out one message at a time and then
// waits for its ack or nack, or for the subscriber to close: it does not
// watch the session. A handler that runs long (a slow downstream, a lock
// wait), or a message nacked again and again, keeps the member in
// ConsumeClaim after the coordinator asked it to rejoin, so the whole group
// waits, with no partition consumed, until the message ends or the
// coordinator removes the member at the rebalance deadline
// (Consumer.Group.Rebalance.Timeout, 60 s by default).
//
// The wrapped handler feeds the claim's records to watermill-kafka's
// ConsumeClaim itself and stops at the session's end, so no record read
// after it reaches the handler; it then waits up to timeout for the message
// in flight and returns, and the member rejoins. The ConsumeClaim it left
// running ends with its message (or with the subscriber), and the next
// session's Cleanup waits for it, at most timeout again. A message still in flight
// then is not marked (watermill-kafka marks only while the session lives):
// the partition's next owner receives it again and the dedup claim absorbs
// it, or waits for it (a claim waits on the unique index until the first
// transaction ends), so the two can never both apply it.
//
// It also records where each claim starts (internal/claimstart), under
// group, for the dedup middleware's comparison with PostgreSQL's position,
// and, before the claim's first record, hands it to the middleware that
// writes it as the partition's first position (Config.KafkaGroups).
//
// With keep (ClientConfig.Progress), each handler keeps the subscription's
// positions in PostgreSQL itself ([progressKeeper]), its first rows
// included: the middleware then writes none.
func revokeBound(next kafka.SaramaTracer, group string, timeout time.Duration, logger watermill.LoggerAdapter, keep func() *progressKeeper) kafka.SaramaTracer {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return handlertracer.New(next, func(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
		rb := &revokeBoundHandler{ConsumerGroupHandler: h, group: group, timeout: timeout, logger: logger}
		if keep != nil {
			rb.keep = keep()
		}
		return rb
	})
}

type revokeBoundHandler struct {
	sarama.ConsumerGroupHandler
	group   string
	timeout time.Duration
	logger  watermill.LoggerAdapter
	keep    *progressKeeper // nil without ClientConfig.Progress
	// detached counts watermill-kafka's ConsumeClaim calls still running
	// after the wrapper returned for them (their message outlived
	// RevokeTimeout).
	detached sync.WaitGroup
}

// Setup moves the claims' start to PostgreSQL's positions (with
// ClientConfig.Progress), then calls the wrapped Setup.
func (h *revokeBoundHandler) Setup(sess sarama.ConsumerGroupSession) error {
	if h.keep != nil {
		if err := h.keep.setup(sess); err != nil {
			return fmt.Errorf("read the positions in PostgreSQL: %w", err)
		}
	}
	return h.ConsumerGroupHandler.Setup(sess)
}

// Cleanup waits, at most timeout, for the ConsumeClaim calls left running
// after an earlier revocation, then calls the wrapped Cleanup. When the
// subscriber closes they end at once (watermill-kafka's ConsumeClaim
// watches the subscriber's closing), and the wait orders their last send on
// the subscriber's output channel before watermill-kafka closes it; on a
// rebalance it costs at most timeout more before the member rejoins.
func (h *revokeBoundHandler) Cleanup(sess sarama.ConsumerGroupSession) error {
	done := make(chan struct{})
	go func() { h.detached.Wait(); close(done) }()
	t := time.NewTimer(h.timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
	return h.ConsumerGroupHandler.Cleanup(sess)
}

// fedClaim is a claim whose records come from the wrapper.
type fedClaim struct {
	sarama.ConsumerGroupClaim
	msgs chan *sarama.ConsumerMessage
}

func (c fedClaim) Messages() <-chan *sarama.ConsumerMessage { return c.msgs }

func (h *revokeBoundHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	claimstart.Started(sess.Context(), h.group, claim.Topic(), claim.Partition(), claim.InitialOffset(), h.keep != nil)
	fed := fedClaim{ConsumerGroupClaim: claim, msgs: make(chan *sarama.ConsumerMessage)}
	done := make(chan error, 1)
	finished := make(chan struct{})
	inner := sess
	var fenced <-chan struct{} // nil (never ready) without Progress
	if h.keep != nil {
		inner = markingSession{ConsumerGroupSession: sess, k: h.keep}
		fenced = h.keep.fencedC()
		// The claim's last marks, once its message in flight is done
		// (or was left running): PostgreSQL first, then Kafka.
		defer h.keep.flush()
	}
	go func() {
		done <- h.ConsumerGroupHandler.ConsumeClaim(inner, fed)
		close(finished)
	}()

	var last *sarama.ConsumerMessage // the record handed out last
	ended := sess.Context().Done()
	tp := topicPartition{claim.Topic(), claim.Partition()}
feed:
	for {
		select {
		case m, ok := <-claim.Messages():
			if !ok {
				break feed
			}
			if h.keep != nil {
				if err := h.keep.ensureRow(tp, m.Offset); err != nil {
					h.logger.Error("Could not write the partition's first position in PostgreSQL: the claim ends, the session is joined again", err,
						watermill.LogFields{"topic": claim.Topic(), "kafka_partition": claim.Partition()})
					break feed
				}
			}
			select {
			case fed.msgs <- m:
				last = m
			case <-ended:
				break feed // m was not handed out: the next owner reads it
			case err := <-done:
				return err
			}
		case <-ended:
			break feed
		case <-fenced:
			break feed // returning ends the session (Sarama cancels it when a claim returns)
		case err := <-done:
			return err
		}
	}
	close(fed.msgs)

	t := time.NewTimer(h.timeout)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
	}
	fields := watermill.LogFields{"topic": claim.Topic(), "kafka_partition": claim.Partition(), "revoke_timeout": h.timeout.String()}
	if last != nil {
		fields["kafka_partition_offset"] = last.Offset
	}
	h.detached.Add(1) // before this call returns, so before the session's Cleanup waits
	go func() { <-finished; h.detached.Done() }()
	h.logger.Info("Partition revoked with a message still in flight after RevokeTimeout: rejoining without it; "+
		"its offset is not committed, so the partition's next owner receives it again", fields)
	return nil
}
