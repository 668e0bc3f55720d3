package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Dedup is the transactional dedup middleware. Create it with [NewDedup] and
// add [Dedup.Middleware] to a handler or router.
type Dedup struct {
	cfg    Config
	dedup  *deduplicator.Deduplicator
	logger watermill.LoggerAdapter
	stats  *counters

	// From the start-up check: the group as registered (first seen,
	// Idempotency-Key namespace).
	group deduplicator.Group
	// strategy processes the messages whose event id passed: the one
	// Config.Mode chose.
	strategy strategy
	tracing  *otelx.Tracers
}

// NewDedup validates cfg, checks the table and registers the consumer group,
// and returns the middleware. Migrate deduplicator.MigrationLine first: NewDedup
// refuses, at start-up rather than at the first message, a missing table or
// pending migrations, a retention that differs from the one recorded with
// the table (deduplicator.ErrRetentionMismatch), an Idempotency-Key
// namespace that differs from the group's (deduplicator.ErrNamespaceMismatch)
// and a StaleMargin not shorter than the retention. The check runs in one
// transaction of cfg.DB, bounded by [Config.StartupTimeout].
func NewDedup(cfg Config, logger watermill.LoggerAdapter) (*Dedup, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("dedup: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	dd, err := deduplicator.New(deduplicator.Config{
		TableConfig: cfg.Table, ConsumerGroup: cfg.ConsumerGroup, StaleMargin: cfg.StaleMargin, ReplayHorizon: cfg.ReplayHorizon, NowFunc: cfg.NowFunc,
	}, logger)
	if err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	d := &Dedup{cfg: cfg, dedup: dd, logger: logger.With(watermill.LogFields{"consumer_group": cfg.ConsumerGroup}), stats: &counters{}}
	d.tracing = &otelx.Tracers{Configured: cfg.TracerProvider, Name: otelx.MiddlewareTracer}
	if err := d.start(); err != nil {
		return nil, err
	}
	d.strategy = newStrategy(&steps{
		db: cfg.DB, txOpts: cfg.TxOptions, claims: dd, group: cfg.ConsumerGroup, keyNS: d.group.IdempotencyNamespace,
		outbox: cfg.Outbox, stats: d.stats, logger: d.logger, tracer: d.tracing,
		progress: newProgressKeeper(cfg, d.stats, d.logger),
	}, cfg)
	return d, nil
}

// start checks the table and registers the group, in one transaction.
func (d *Dedup) start() error {
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.StartupTimeout)
	defer cancel()
	err := pgx.BeginFunc(ctx, d.cfg.DB, func(tx pgx.Tx) error {
		if err := deduplicator.Check(ctx, tx, d.cfg.Table); err != nil {
			return err
		}
		g, err := d.dedup.Register(ctx, tx, d.cfg.IdempotencyNamespace)
		d.group = g
		return err
	})
	if err != nil {
		return fmt.Errorf("dedup: start-up check of consumer group %q: %w", d.cfg.ConsumerGroup, err)
	}
	d.logger.Debug("Dedup started", watermill.LogFields{
		"group_first_seen": d.group.FirstSeen, "idempotency_namespace": d.group.IdempotencyNamespace,
	})
	return nil
}

// Stats returns the middleware's counters since it was created.
func (d *Dedup) Stats() Stats { return d.stats.snapshot() }

// ConsumerGroup returns the consumer group the middleware claims for
// ([Config.ConsumerGroup]).
func (d *Dedup) ConsumerGroup() string { return d.cfg.ConsumerGroup }

// Middleware wraps h so that each message is applied at most once per
// consumer group, atomically with the handler's writes:
//
//  1. extract and validate the event id (a refusal is a permanent error);
//  2. BEGIN; INSERT the claim ON CONFLICT DO NOTHING (one round trip);
//  3. duplicate: ROLLBACK and return nil (the message is acked, h not run);
//  4. first: run h with the transaction in msg.Context();
//  5. h returned an error or panicked: ROLLBACK and propagate it (nack);
//  6. messages h returned go to [Config.Outbox] in the same transaction;
//  7. COMMIT; only then does the router ack and the offset advance.
//
// In lease mode ([Config.Mode] a *[LeaseConfig]) steps 2–7 split into two
// short transactions around a handler that holds none: see [LeaseConfig].
// With group commit (a *[GroupCommitConfig]) the messages that arrive
// together share steps 2 and 7.
//
// The message's original context is restored when Middleware returns. Put
// watermill's Retry middleware outside (before) this one, so every attempt
// gets a fresh transaction.
func (d *Dedup) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx, span := d.startSpan(msg)
		if span == nil { // tracing off: nothing else to do
			produced, _, err := d.process(msg, h, nil)
			return produced, err
		}
		orig := msg.Context()
		msg.SetContext(ctx) // the handler's own spans nest under the message's
		defer msg.SetContext(orig)
		ended := false
		defer func() {
			if !ended { // a handler panic on its way up: end the span, keep panicking
				p := recover()
				span.end(outcomeFailed, fmt.Errorf("handler panicked: %v", p))
				panic(p)
			}
		}()
		produced, outcome, err := d.process(msg, h, span)
		span.end(outcome, err)
		ended = true
		return produced, err
	}
}

// process checks the message's event id (stale guard included) and hands
// it to the strategy of the configured mode.
func (d *Dedup) process(msg *message.Message, h message.HandlerFunc, span *msgSpan) ([]*message.Message, string, error) {
	id, outcome, err := d.admit(msg)
	if err != nil {
		return nil, outcome, err
	}
	span.eventID(id)
	return d.strategy.process(msg, h, id, span)
}

// newStrategy returns the strategy cfg.Mode chooses.
func newStrategy(s *steps, cfg Config) strategy {
	switch m := cfg.Mode.(type) {
	case *LeaseConfig:
		return newLeaseMode(s, *m, cfg.DB.(dbx.Concurrent))
	case *GroupCommitConfig:
		return newGroupMode(s, *m)
	}
	return &txMode{s: s}
}

// start begins the consumer span of msg. Its parent is the span already in
// msg.Context() (watermill-kafka's Sarama tracer puts one there), or else the
// trace context the producer left in the metadata (traceparent, tracestate,
// baggage). It returns nil when tracing is off.
func (d *Dedup) startSpan(msg *message.Message) (context.Context, *msgSpan) {
	tr := d.tracing.Tracer()
	if tr == nil {
		return msg.Context(), nil
	}
	return d.startSpanOn(tr, msg)
}

// startSpanOn is startSpan with tracer tr. It is apart so that, with
// tracing off, startSpan's stack frame stays small: the router runs each
// message in a new goroutine, whose small stack would otherwise be grown
// (copied) for this frame alone while the message waits for its group.
func (d *Dedup) startSpanOn(tr trace.Tracer, msg *message.Message) (context.Context, *msgSpan) {
	ctx := msg.Context()
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = otelx.Propagator.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	}
	topic := message.SubscribeTopicFromCtx(msg.Context())
	name := "process"
	if topic != "" {
		name += " " + topic
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingConsumerGroupName(d.cfg.ConsumerGroup),
		semconv.MessagingMessageID(msg.UUID),
	}
	ctx, span := tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(append(attrs, kafkaAttributes(msg.Context(), d.cfg.TraceMessageKey)...)...))
	return ctx, &msgSpan{span: span}
}

// admit returns msg's event id, or the outcome and error that refuse it:
// an unusable id, a stale event (both permanent), or a failed stale check.
func (d *Dedup) admit(msg *message.Message) (uuid.UUID, string, error) {
	id, err := d.eventID(msg)
	if err == nil && id.Version() == 7 && !d.cfg.ProcessStaleEvents {
		err = d.dedup.CheckStale(msg.Context(), d.cfg.DB, id, d.cfg.NowFunc())
		if err != nil && !errors.Is(err, deduplicator.ErrStaleEvent) {
			d.stats.claimErrors.Add(1)
			return uuid.Nil, outcomeClaimError, fmt.Errorf("dedup: %w", err)
		}
	}
	if err != nil {
		d.stats.rejected(err)
		d.logger.Error("Refusing message: unusable event id", err, watermill.LogFields{"message_uuid": msg.UUID})
		if errors.Is(err, deduplicator.ErrStaleEvent) {
			return uuid.Nil, outcomeStale, err
		}
		return uuid.Nil, outcomeRejected, err
	}
	return id, "", nil
}

// eventID extracts and validates the message's id.
func (d *Dedup) eventID(msg *message.Message) (uuid.UUID, error) {
	id, err := d.cfg.EventIDFunc(msg)
	if err != nil {
		var ee *publisher.EventIDError
		if !errors.As(err, &ee) && !IsPermanent(err) {
			// A custom EventIDFunc's own error: keep it, but make it routable.
			err = &publisher.EventIDError{Reason: publisher.ErrInvalidEventID, Source: "func", Detail: err.Error()}
		}
		return uuid.Nil, err
	}
	if err := publisher.ValidateEventID(id, d.cfg.AllowNonV7); err != nil {
		return uuid.Nil, err
	}
	return id, nil
}
