package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Dedup is the transactional dedup middleware. Create it with [NewDedup] and
// add [Dedup.Middleware] to a handler or router.
type Dedup struct {
	cfg    Config
	dedup  *deduplicator.Deduplicator
	logger watermill.LoggerAdapter
	stats  counters

	// From the start-up check: the group as registered (first seen,
	// Idempotency-Key namespace).
	group deduplicator.Group
	// gc is the group-commit mode, nil when Config.GroupCommit is.
	gc *groupCommit
	// lease is lease mode, nil when Config.Lease is.
	lease   *leaseMode
	tracing otelx.Tracers
	// watch checks the Kafka position of watermill-kafka's messages
	// against PostgreSQL's (progress.go).
	watch progressWatch
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
	dd, err := deduplicator.New(deduplicator.Config{TableConfig: cfg.Table, ConsumerGroup: cfg.ConsumerGroup, StaleMargin: cfg.StaleMargin, ReplayHorizon: cfg.ReplayHorizon}, logger)
	if err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	d := &Dedup{cfg: cfg, dedup: dd, logger: logger.With(watermill.LogFields{"consumer_group": cfg.ConsumerGroup})}
	d.tracing = otelx.Tracers{Configured: cfg.TracerProvider, Name: otelx.MiddlewareTracer}
	if err := d.start(); err != nil {
		return nil, err
	}
	if cfg.GroupCommit != nil {
		d.gc = newGroupCommit(d, *cfg.GroupCommit)
	}
	if cfg.Lease != nil {
		d.lease = newLeaseMode(d, *cfg.Lease)
	}
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
// In lease mode ([Config.Lease]) steps 2–7 split into two short
// transactions around a handler that holds none: see [LeaseConfig].
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

// process validates the message's event id (stale guard included) and
// processes it, in a group or alone, and names the outcome.
func (d *Dedup) process(msg *message.Message, h message.HandlerFunc, span *msgSpan) ([]*message.Message, string, error) {
	id, err := d.eventID(msg)
	if err == nil && id.Version() == 7 && !d.cfg.ProcessStaleEvents {
		err = d.dedup.CheckStale(msg.Context(), d.cfg.DB, id, d.cfg.NowFunc())
		if err != nil && !errors.Is(err, deduplicator.ErrStaleEvent) {
			d.stats.claimErrors.Add(1)
			return nil, outcomeClaimError, fmt.Errorf("dedup: %w", err)
		}
	}
	if err != nil {
		d.stats.rejected(err)
		d.logger.Error("Refusing message: unusable event id", err, watermill.LogFields{"message_uuid": msg.UUID})
		if errors.Is(err, deduplicator.ErrStaleEvent) {
			return nil, outcomeStale, err
		}
		return nil, outcomeRejected, err
	}
	span.eventID(id)
	if d.lease != nil {
		return d.lease.process(msg, h, id, span)
	}
	if d.gc != nil {
		if !d.gc.failed.has(id) {
			if res := d.gc.submit(msg, h, id, span); !res.alone {
				return res.produced, res.outcome, res.err
			}
		}
		d.stats.alone.Add(1)
	}
	return d.single(msg, h, id, span)
}

// single processes one message in its own transaction.
func (d *Dedup) single(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) (produced []*message.Message, outcome string, err error) {
	origCtx := msg.Context()
	defer msg.SetContext(origCtx)
	fields := watermill.LogFields{"event_id": id.String(), "message_uuid": msg.UUID}

	start := time.Now()
	tx, first, err := d.dedup.BeginClaim(d.progressContext(origCtx, msg), d.cfg.DB, d.cfg.TxOptions, id)
	d.stats.claimed(time.Since(start))
	if err != nil {
		err = fmt.Errorf("dedup: %w", err)
	} else {
		span.claimed(time.Since(start), first)
	}
	if tx == nil {
		d.stats.claimErrors.Add(1)
		return nil, outcomeClaimError, err
	}
	done, handlerFailed := false, false
	defer func() {
		if !done { // error, duplicate or panic
			d.rollback(origCtx, tx, fields)
		}
	}()
	if err != nil {
		d.stats.claimErrors.Add(1)
		return nil, outcomeClaimError, err
	}
	if !first {
		d.stats.duplicates.Add(1)
		d.logger.Debug("Duplicate event skipped", fields)
		return nil, outcomeDuplicate, nil
	}
	defer func() {
		if !done { // handler error or panic, outbox or commit failure
			d.stats.failed.Add(1)
			if d.gc != nil && handlerFailed {
				d.gc.failed.add(id) // stays alone on its later attempts
			}
		}
	}()

	hooks := &idemctx.Hooks{Tx: tx}
	msg.SetContext(d.handlerContext(origCtx, tx, hooks, msg, id))
	handlerFailed = true // until h returns: an error or a panic
	produced, err = h(msg)
	if err != nil {
		return nil, outcomeFailed, err
	}
	if err := txUsable(tx); err != nil {
		return nil, outcomeFailed, err
	}
	handlerFailed = false
	if produced, err = d.toOutbox(msg.Context(), origCtx, tx, produced); err != nil {
		return nil, outcomeFailed, err
	}
	span.event("commit")
	if err := tx.Commit(origCtx); err != nil {
		// The outcome is unknown (the COMMIT may have reached the server).
		// Returning the error nacks the message; the redelivery's claim
		// tells which way it went.
		return nil, outcomeFailed, fmt.Errorf("dedup: commit: %w", err)
	}
	done = true
	hooks.Committed()
	d.stats.processed.Add(1)
	d.stats.txNanos.Add(uint64(time.Since(start)))
	d.logger.Trace("Event processed", fields.Add(watermill.LogFields{"tx_duration": time.Since(start).String()}))
	return produced, outcomeProcessed, nil
}

// handlerContext is the context a handler sees: origCtx with the
// transaction and the event, and the hooks to run once tx has committed.
func (d *Dedup) handlerContext(origCtx context.Context, tx pgx.Tx, hooks *idemctx.Hooks, msg *message.Message, id uuid.UUID) context.Context {
	return idemctx.WithHandler(origCtx, idemctx.Value{
		Tx: tx, EventID: id, ConsumerGroup: d.cfg.ConsumerGroup, KeyNamespace: d.group.IdempotencyNamespace,
		CorrelationID: msg.Metadata.Get(publisher.MetadataCorrelationID),
	}, hooks)
}

// toOutbox writes the messages a handler returned to [Config.Outbox] in tx
// and returns none; without an Outbox it returns them unchanged (for the
// router, after COMMIT). The publish topic comes from the router, in
// origCtx.
func (d *Dedup) toOutbox(ctx, origCtx context.Context, tx pgx.Tx, produced []*message.Message) ([]*message.Message, error) {
	if len(produced) == 0 {
		return nil, nil
	}
	if d.cfg.Outbox == nil {
		for _, m := range produced {
			otelx.Inject(ctx, m) // the handler's trace goes on with them (no-op without a span)
		}
		return produced, nil
	}
	topic := message.PublishTopicFromCtx(origCtx)
	if topic == "" {
		return nil, errors.New("dedup: handler returned messages but has no publish topic (add it with router.AddHandler)")
	}
	if err := d.cfg.Outbox.PublishInTx(ctx, tx, topic, produced...); err != nil {
		return nil, fmt.Errorf("dedup: write returned messages to outbox: %w", err)
	}
	return nil, nil
}

// txUsable returns ErrTxAborted when tx can no longer commit: a statement
// failed in it (PostgreSQL then refuses every statement until ROLLBACK) or
// it was ended behind the middleware's back. It reads the status of the
// connection's last ReadyForQuery message: no round trip.
func txUsable(tx pgx.Tx) error {
	c := tx.Conn()
	if c == nil || c.IsClosed() {
		return nil // the COMMIT reports it
	}
	switch st := c.PgConn().TxStatus(); st {
	case 'T':
		return nil
	case 'E':
		return fmt.Errorf("dedup: %w (a statement failed and the handler returned nil)", ErrTxAborted)
	default:
		return fmt.Errorf("dedup: %w (the handler ended the transaction: status %q)", ErrTxAborted, st)
	}
}

func (d *Dedup) rollback(ctx context.Context, tx pgx.Tx, fields watermill.LogFields) {
	err := tx.Rollback(context.WithoutCancel(ctx))
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		d.logger.Error("Rollback failed", err, fields)
	}
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
