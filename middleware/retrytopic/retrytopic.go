package retrytopic

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/watermill-idempotency/internal/wait"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// RetryTopic moves transient failures off their partition onto retry topics
// and back into the handler after a backoff, then to the poison topic. Create
// it with [New]; add [RetryTopic.Middleware] to the main and the retry
// handlers (router.AddMiddleware does both), outside watermill's Retry.
type RetryTopic struct {
	cfg    Config
	logger watermill.LoggerAdapter
	retry  map[string]bool // the retry topics
	order  *keyOrder       // nil without Config.KeyOrder
	stats  counters
}

// New validates cfg and returns the middleware. With [Config.KeyOrder] it
// checks that the parked-keys table is migrated (a *migrate.TableError
// wrapping migrate.ErrMigrationsPending if not), bounded by
// [Config.StartupTimeout].
func New(cfg Config, logger watermill.LoggerAdapter) (*RetryTopic, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("retrytopic: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	r := &RetryTopic{cfg: cfg, logger: logger, retry: map[string]bool{}}
	for _, t := range cfg.Topics {
		r.retry[t] = true
	}
	if cfg.KeyOrder != nil {
		r.order = newKeyOrder(*cfg.KeyOrder, cfg.Topics[0], cfg.NowFunc, logger, &r.stats)
		ctx, cancel := context.WithTimeout(context.Background(), cfg.StartupTimeout)
		defer cancel()
		if err := r.order.check(ctx); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// Stats returns the counters since [New].
func (r *RetryTopic) Stats() Stats { return r.stats.snapshot() }

// isRetryTopic reports whether topic is one of [Config.Topics].
func (r *RetryTopic) isRetryTopic(topic string) bool { return r.retry[topic] }

// Middleware handles what the handler chain inside it (watermill's Retry,
// then the dedup middleware, then the handler) could not:
//
//   - a transient error: a copy of the message (same UUID, payload and
//     metadata, event_id included) goes to the retry topic of the next
//     attempt with the retry headers ([MetadataAttempt], [MetadataNotBefore],
//     the original topic, partition and offset, [MetadataError]), and the
//     message is acked, so its partition moves on;
//   - a permanent error ([Config.IsPermanentFunc]), or a transient one after
//     the last attempt ([ErrAttemptsExhausted]): the message goes to the poison
//     topic with watermill's poison metadata, topic_poisoned naming the
//     original topic, and is acked;
//   - a publish failure is returned (the message is nacked and redelivered),
//     and so is any error once the message context has ended (the router
//     is closing: the message is neither moved nor poisoned).
//
// On a message consumed from a retry topic it first waits for the copy's
// not-before time (ending early, with the context's error, when the message
// context ends). With [Config.KeyOrder] it also parks and releases keys; see
// [KeyOrder] and [RetryTopic.ReleaseMiddleware].
func (r *RetryTopic) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		orig := ctx
		o, onRetry, err := r.origin(msg)
		if err != nil {
			return nil, r.poison(ctx, msg, o, nil, err)
		}
		if onRetry {
			if err := r.hold(ctx, o.notBefore); err != nil {
				return nil, err
			}
		}
		var pk *parking
		if r.order != nil {
			var run bool
			pk, run, err = r.order.admit(ctx, msg, onRetry, func() *message.Message { return r.waitingCopy(msg, o) })
			if err != nil || !run {
				return nil, err
			}
			if pk != nil && pk.parked {
				ctx = withRelease(ctx, pk)
				msg.SetContext(ctx)
				defer msg.SetContext(orig)
			}
		}
		produced, err := h(msg)
		if err == nil {
			if err := r.order.finish(ctx, pk, onRetry); err != nil {
				return nil, err
			}
			if onRetry {
				r.stats.recovered.Add(1)
			}
			return produced, nil
		}
		if orig.Err() != nil {
			// The router or subscriber is closing: nack, the next owner of
			// the partition gets the message.
			return nil, err
		}
		if r.cfg.IsPermanentFunc(err) {
			return nil, r.poison(ctx, msg, o, pk, err)
		}
		if o.attempt >= r.cfg.MaxAttempts {
			return nil, r.poison(ctx, msg, o, pk, exhausted(o.attempt, err))
		}
		return nil, r.escalate(ctx, msg, o, pk, err)
	}
}

// origin tells where msg stands: a copy on a retry topic (its headers), or
// a message of a main topic (attempt 0, its own topic and position).
func (r *RetryTopic) origin(msg *message.Message) (origin, bool, error) {
	ctx := msg.Context()
	topic := message.SubscribeTopicFromCtx(ctx)
	if r.retry[topic] {
		o, err := parseOrigin(msg)
		if o.topic == "" {
			o.topic = topic
		}
		return o, true, err
	}
	o := origin{topic: topic}
	if p, ok := kafka.MessagePartitionFromCtx(ctx); ok {
		o.partition = strconv.FormatInt(int64(p), 10)
	}
	if off, ok := kafka.MessagePartitionOffsetFromCtx(ctx); ok {
		o.offset = strconv.FormatInt(off, 10)
	}
	return o, false, nil
}

// hold waits until notBefore, or until ctx ends.
func (r *RetryTopic) hold(ctx context.Context, notBefore time.Time) error {
	if notBefore.IsZero() {
		return nil
	}
	d := notBefore.Sub(r.cfg.NowFunc())
	if d <= 0 {
		return nil
	}
	r.stats.held.Add(1)
	if err := wait.Sleep(ctx, d); err != nil {
		return fmt.Errorf("retrytopic: waiting for not-before %s: %w", notBefore.UTC().Format(time.RFC3339Nano), err)
	}
	return nil
}

// copyFor returns the copy of msg that travels on: same UUID, payload and
// metadata; a Kafka record key without partition_key metadata becomes
// partition_key, so the copy keeps its key's partition.
func copyFor(msg *message.Message) *message.Message {
	c := msg.Copy()
	if c.Metadata.Get(publisher.MetadataPartitionKey) == "" {
		if key, ok := kafka.MessageKeyFromCtx(msg.Context()); ok && len(key) > 0 {
			c.Metadata.Set(publisher.MetadataPartitionKey, string(key))
		}
	}
	return c
}

// escalate publishes the copy of the next attempt (parking its key first
// with KeyOrder, in the transaction that commits after the publish).
func (r *RetryTopic) escalate(ctx context.Context, msg *message.Message, o origin, pk *parking, cause error) error {
	next := o
	next.attempt = o.attempt + 1
	next.notBefore = r.cfg.NowFunc().Add(r.cfg.Backoff.randomDelay(next.attempt))
	topic := r.cfg.topic(next.attempt)
	c := copyFor(msg)
	next.set(c.Metadata, cause)
	publish := func() error {
		if err := r.cfg.Publisher.Publish(topic, c); err != nil {
			return fmt.Errorf("retrytopic: publish attempt %d to %s: %w (the message is nacked: %v)", next.attempt, topic, err, cause)
		}
		return nil
	}
	if pk != nil {
		c.Metadata.Set(MetadataParked, "true")
		queued, err := r.order.park(ctx, pk, topic, next.notBefore, c, publish)
		if err != nil {
			return err
		}
		if queued {
			// Its key was parked by another event meanwhile: it waits
			// behind that one, its copy kept in the table.
			r.stats.followed.Add(1)
			r.logger.Debug("Failed event waits behind its key's parked event", pk.fields())
			return nil
		}
	} else if err := publish(); err != nil {
		return err
	}
	r.stats.retried.Add(1)
	r.logger.Debug("Transient failure moved to a retry topic", watermill.LogFields{
		"message_uuid": msg.UUID, "retry_topic": topic, "attempt": next.attempt,
		"not_before": next.notBefore.UTC().Format(time.RFC3339Nano), "original_topic": o.topic, "err": truncate(cause.Error(), maxErrorLen),
	})
	return nil
}

// waitingCopy is the message a parked event keeps while it waits behind
// its key's first event: the copy it will have on the retry path, its
// attempt unchanged (0 from the main topic) and its not-before time set
// when it is handed off.
func (r *RetryTopic) waitingCopy(msg *message.Message, o origin) *message.Message {
	c := copyFor(msg)
	next := o
	next.notBefore = time.Time{}
	next.set(c.Metadata, nil)
	delete(c.Metadata, MetadataNotBefore)
	c.Metadata.Set(MetadataParked, "true")
	if e := msg.Metadata.Get(MetadataError); e != "" && o.attempt > 0 {
		c.Metadata.Set(MetadataError, e) // a failed copy keeps its last failure
	}
	return c
}

// poison publishes msg to the poison topic with watermill's poison metadata
// (topic_poisoned is the original topic), then releases its parked key.
func (r *RetryTopic) poison(ctx context.Context, msg *message.Message, o origin, pk *parking, reason error) error {
	c := copyFor(msg)
	c.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reason.Error())
	c.Metadata.Set(wmiddleware.PoisonedTopicKey, o.topic)
	c.Metadata.Set(wmiddleware.PoisonedHandlerKey, message.HandlerNameFromCtx(ctx))
	c.Metadata.Set(wmiddleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(ctx))
	if err := r.cfg.Publisher.Publish(r.cfg.PoisonTopic, c); err != nil {
		return fmt.Errorf("retrytopic: publish to poison topic %s: %w (the message is nacked: %v)", r.cfg.PoisonTopic, err, reason)
	}
	r.stats.poisoned.Add(1)
	if errors.Is(reason, ErrAttemptsExhausted) {
		r.stats.exhausted.Add(1)
	}
	r.logger.Error("Message poisoned", reason, watermill.LogFields{
		"message_uuid": msg.UUID, "poison_topic": r.cfg.PoisonTopic, "original_topic": o.topic, "attempt": o.attempt,
	})
	if pk != nil && pk.parked {
		if err := r.order.releaseNow(ctx, pk); err != nil {
			return err
		}
		r.order.released(pk)
	}
	return nil
}
