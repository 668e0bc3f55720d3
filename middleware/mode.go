package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// strategy processes a message whose event id has been checked: one
// implementation per mode (River's JobCompleter), picked once by [NewDedup]
// from [Config.Mode].
// txMode runs one transaction per message, groupMode lets concurrent
// messages share one, leaseMode runs the handler between two short
// transactions (and its fast path). A mode returns the messages for the
// router, the outcome it names on the span, and the error that nacks.
// It restores msg's context before it returns.
type strategy interface {
	process(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) ([]*message.Message, string, error)
}

var (
	_ strategy = (*txMode)(nil)
	_ strategy = (*groupMode)(nil)
	_ strategy = (*leaseMode)(nil)
)

// steps is what every mode shares: where claims go, what a handler's
// context holds, where returned messages go, the counters, the logger and
// the tracer. It is built once by NewDedup and never changed; the modes
// hold it, not the Dedup.
type steps struct {
	db     migrate.Beginner
	txOpts pgx.TxOptions
	claims *deduplicator.Deduplicator
	group  string // the consumer group
	keyNS  string // the group's Idempotency-Key namespace
	outbox OutboxWriter
	stats  *counters
	logger watermill.LoggerAdapter
	tracer *otelx.Tracers
	// progress writes the group's Kafka position with the claims: every
	// mode claims on progress.progressContext's context (nil-safe).
	progress *progressKeeper
}

// handlerContext is the context a handler sees: origCtx with the
// transaction and the event, and the hooks to run once tx has committed.
func (s *steps) handlerContext(origCtx context.Context, tx pgx.Tx, hooks *idemctx.Hooks, msg *message.Message, id uuid.UUID) context.Context {
	return idemctx.WithHandler(origCtx, s.handlerValue(tx, msg, id), hooks)
}

// handlerValue is what [TxFromContext], [EventIDFromContext] and the
// Idempotency-Key read; tx is nil in lease mode's call.
func (s *steps) handlerValue(tx pgx.Tx, msg *message.Message, id uuid.UUID) idemctx.Value {
	return idemctx.Value{
		Tx: tx, EventID: id, ConsumerGroup: s.group, KeyNamespace: s.keyNS,
		CorrelationID: msg.Metadata.Get(publisher.MetadataCorrelationID),
	}
}

// toOutbox writes the messages a handler returned to [Config.Outbox] in tx
// and returns none; without an Outbox it returns them unchanged (for the
// router, after COMMIT). The publish topic comes from the router, in
// origCtx.
func (s *steps) toOutbox(ctx, origCtx context.Context, tx pgx.Tx, produced []*message.Message) ([]*message.Message, error) {
	if len(produced) == 0 {
		return nil, nil
	}
	if s.outbox == nil {
		for _, m := range produced {
			otelx.Inject(ctx, m) // the handler's trace goes on with them (no-op without a span)
		}
		return produced, nil
	}
	topic, err := publishTopic(origCtx)
	if err != nil {
		return nil, err
	}
	return nil, s.writeOutbox(ctx, tx, topic, produced)
}

// writeOutbox writes msgs to the outbox, for topic, in tx.
func (s *steps) writeOutbox(ctx context.Context, tx pgx.Tx, topic string, msgs []*message.Message) error {
	if err := s.outbox.PublishInTx(ctx, tx, topic, msgs...); err != nil {
		return fmt.Errorf("dedup: write returned messages to outbox: %w", err)
	}
	return nil
}

// publishTopic is the router's publish topic of the handler, in ctx.
func publishTopic(ctx context.Context) (string, error) {
	topic := message.PublishTopicFromCtx(ctx)
	if topic == "" {
		return "", errors.New("dedup: handler returned messages but has no publish topic (add it with router.AddHandler)")
	}
	return topic, nil
}

// rollback rolls tx back, whatever ctx's state, and logs a failure other
// than a transaction already closed.
func (s *steps) rollback(ctx context.Context, tx pgx.Tx, fields watermill.LogFields) {
	err := tx.Rollback(context.WithoutCancel(ctx))
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		s.logger.Error("Rollback failed", err, fields)
	}
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
