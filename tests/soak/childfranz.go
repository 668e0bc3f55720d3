package soak

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// errPlannedFailure marks the handler's planned transient failures
// (downstream): on the share-group leg the in-process retries leave them
// to the broker's redelivery, whose delivery count they are to drive.
var errPlannedFailure = errors.New("soak: planned failure")

// addFranzHandlers consumes the main topic and each retry topic with
// idemkafka/franz's Subscriber on the run's group protocol (KIP-848's
// "consumer", or "classic" cooperative-sticky): key order, up to
// [ParallelMaxInFlight] messages in flight on the main topic,
// [ParallelRetryMaxInFlight] on each retry topic. The franz Subscriber has
// no NotBeforeFunc: a retry copy waits for its not-before time in the
// retry-topic middleware (holding its slot). In a run with the failover
// fault each keeps its group's position in PostgreSQL (Progress).
func (c *child) addFranzHandlers(router *message.Router, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	base := franz.SubscriberConfig{Brokers: cfg.Brokers, ConsumerGroup: cfg.Group, GroupProtocol: cfg.GroupProtocol, MaxInFlight: ParallelMaxInFlight,
		InstanceID: cfg.InstanceID}
	if cfg.Progress {
		base.Progress, base.ProgressSchema = c.pool, cfg.Schema
	}
	sub, err := franz.NewSubscriber(base, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("soak-"+cfg.Instance, cfg.Topic, sub, c.handler)
	for i, topic := range cfg.RetryTopics {
		rc := base
		rc.ConsumerGroup = retryGroup(cfg.Group, i)
		rc.MaxInFlight = ParallelRetryMaxInFlight
		rsub, err := franz.NewSubscriber(rc, logger)
		if err != nil {
			return err
		}
		router.AddConsumerHandler(fmt.Sprintf("soak-%s-retry%d", cfg.Instance, i+1), topic, rsub, c.handler)
	}
	return nil
}

// runShare is the share-group leg's router: the main topic consumed as a
// member of the group's KIP-932 share group (no order; no retry topic),
// with the chain docs/engines.md prescribes: the poison queue (filtered by
// idem.IsPermanent), franz.RecordErrors (from delivery
// [ShareMaxDeliveries] on, a failure is permanent), in-process retries of
// the failures that are not planned (a database outage must not spend the
// broker's deliveries), then the dedup middleware.
func (c *child) runShare(ctx context.Context, dedup *idem.Dedup, pub message.Publisher, logger watermill.LoggerAdapter) error {
	cfg := c.cfg
	poison, err := middleware.PoisonQueueWithFilter(tapPublisher{Publisher: pub, c: c}, cfg.PoisonTopic, idem.IsPermanent)
	if err != nil {
		return err
	}
	inProcess := middleware.Retry{
		MaxRetries:      shareInProcessRetries,
		InitialInterval: 100 * time.Millisecond,
		MaxInterval:     time.Second,
		Multiplier:      2,
		ShouldRetry: func(p middleware.RetryParams) bool {
			return !idem.IsPermanent(p.Err) && !errors.Is(p.Err, errPlannedFailure)
		},
	}
	sub, err := franz.NewSubscriber(franz.SubscriberConfig{
		Brokers: cfg.Brokers, ShareGroup: cfg.Group, Ordering: parallel.OrderNone,
		MaxInFlight: ParallelMaxInFlight, MaxDeliveries: ShareMaxDeliveries, IsPermanentFunc: idem.IsPermanent,
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(c.outer(ctx), poison, franz.RecordErrors, inProcess.Middleware, c.attempt, dedup.Middleware)
	router.AddConsumerHandler("soak-"+cfg.Instance, cfg.Topic, sub, c.handler)
	return c.runRouter(ctx, router)
}

// shareInProcessRetries is the share-group leg's in-process retries of a
// failure that is not planned: 100 ms doubling to 1 s, about 12 s in all,
// longer than a database disruption ([DefaultOutage]).
const shareInProcessRetries = 15

// runRouter runs router until ctx ends, and reports "ready" once it runs.
func (c *child) runRouter(ctx context.Context, router *message.Router) error {
	go func() {
		select {
		case <-router.Running():
			c.emit(lineReady)
		case <-ctx.Done():
		}
	}()
	return router.Run(ctx) // until SIGTERM: Close leaves the group, in-flight messages are not acked
}

// franzDelivered marks, on the franz engine, every consumer group of the
// process joined at its first main-topic delivery: a franz Subscriber
// reports no session, and the armed kills wait for the process to consume.
// The gate exists for the classic protocol's first JoinGroup (see
// [sessionTracer]); KIP-848 and share groups have no such barrier.
func (c *child) franzDelivered() {
	if c.cfg.Engine != EngineFranz || c.allJoined.Load() {
		return
	}
	for i := range c.joined {
		c.session(i)
	}
}
