package retrytopic

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// defaultKeyFunc is the default [KeyOrder.KeyFunc]: the partition_key
// metadata (publisher.MetadataPartitionKey, which the library's Kafka
// marshaler turns into the record key), else the Kafka record key of the
// consumed message.
func defaultKeyFunc(msg *message.Message) string {
	if k := msg.Metadata.Get(publisher.MetadataPartitionKey); k != "" {
		return k
	}
	if k, ok := kafka.MessageKeyFromCtx(msg.Context()); ok {
		return string(k)
	}
	return ""
}

// keyOrder keeps the parked-keys table of [KeyOrder] in two steps around
// the handler: [keyOrder.admit] before it, [keyOrder.finish] after it
// succeeded (a failure parks the key, see park, or poisons the event and
// releases it, see releaseNow).
//
// A key's parked events are its rows, in seq order; the first ("head") is
// the only one with a copy on the retry path (topic and not_before set).
// The others wait with their message (topic NULL) until the head is
// released: the release, in the transaction that deletes the head's row,
// hands the key to the next row and writes that event to handoffTopic
// through the outbox. Parking behind a head and handing off both lock the
// key's head row (lockHead), so a follower is never parked behind a head
// that a concurrent release has just deleted without handing the key on.
type keyOrder struct {
	cfg          KeyOrder
	sql          statements
	handoffTopic string
	now          func() time.Time
	logger       watermill.LoggerAdapter
	stats        *counters
	late         *overdueCheck // nil with OverdueAfter -1
	// hook, set by tests (export_test.go), is called at each step.
	hook func(s step, id uuid.UUID)
}

// step is a point of a keyOrder transaction where a test can pause it.
type step int

const (
	// stepWaitInserted: wait inserted its row, before the COMMIT.
	stepWaitInserted step = iota + 1
)

func (o *keyOrder) step(s step, id uuid.UUID) {
	if o.hook != nil {
		o.hook(s, id)
	}
}

// newKeyOrder returns the key order of cfg, its hand-offs written to
// handoffTopic. logger and stats may be nil when only the table's steps
// are used (Unblock).
func newKeyOrder(cfg KeyOrder, handoffTopic string, now func() time.Time, logger watermill.LoggerAdapter, stats *counters) *keyOrder {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if stats == nil {
		stats = &counters{}
	}
	o := &keyOrder{cfg: cfg, sql: newStatements(ident.Quote(cfg.Table.Schema, cfg.Table.Table)),
		handoffTopic: handoffTopic, now: now, logger: logger, stats: stats}
	o.late = newOverdueCheck(o, logger)
	return o
}

// parking is a keyed message's place in the parked-keys table.
type parking struct {
	group, key string
	id         uuid.UUID
	// parked: the event has a row.
	parked bool
	// head is the key's first parked event, nil when the key is free.
	head *uuid.UUID
	// done: ReleaseMiddleware released it in the handler's transaction.
	done atomic.Bool
	// handedOff: a release of this event handed the key to the next one.
	handedOff atomic.Bool
}

func (p *parking) fields() watermill.LogFields {
	f := watermill.LogFields{"event_id": p.id.String(), "consumer_group": p.group}
	if p.head != nil {
		f["parked_head"] = p.head.String()
	}
	return f
}

// checker is implemented by *outbox.Outbox: it verifies a topic's table.
type checker interface {
	Check(ctx context.Context, db dbx.Beginner, topics ...string) error
}

// check refuses a parked-keys table with pending migrations, and an outbox
// without a table for the hand-off topic.
func (o *keyOrder) check(ctx context.Context) error {
	if err := checkMigrated(ctx, o.cfg.DB, o.cfg.Table); err != nil {
		return err
	}
	if c, ok := o.cfg.Outbox.(checker); ok {
		if err := c.Check(ctx, o.cfg.DB, o.handoffTopic); err != nil {
			return fmt.Errorf("retrytopic: KeyOrder.Outbox: the hand-off topic %s (Topics[0]): %w", o.handoffTopic, err)
		}
	}
	return nil
}

// admit decides, before the handler, whether msg runs now (run true), or
// is acked without running because its key is parked (run false). pk is
// the message's place in the table, nil for a message without a key or a
// usable event id: those are never held back (the dedup middleware refuses
// an unusable id anyway).
//
// On the main topic a parked event is acked (it waits in the table or its
// copy is on the retry path) and any other event of a parked key parks
// behind the head with its message (waiting makes it) and is acked. On a
// retry topic the head runs; a copy of another parked event is acked (its
// row keeps it); a copy of an event without a row is probed when its key
// is parked by another or when the copy is marked ([MetadataParked]):
// acked when stale, looked at again when its park was under way. An
// unmarked copy whose key is free runs (the dedup claim decides; see
// settle). A marked copy never runs without its row: after a failover to
// an asynchronous standby, a copy published after the replication cut has
// none, and running it would apply its event before the events of its key
// that the promotion undid and that come again from the main topic.
func (o *keyOrder) admit(ctx context.Context, msg *message.Message, onRetry bool, waiting func() *message.Message) (pk *parking, run bool, err error) {
	if ord, ok := parallel.OrderingFromContext(ctx); ok && ord == parallel.OrderNone {
		// Nothing is moved, poisoned or applied: the message is nacked
		// until the subscriber is configured right.
		o.logger.Error("KeyOrder refuses a message of a parallel.Subscriber with OrderNone", ErrKeyOrderUnordered, nil)
		return nil, false, ErrKeyOrderUnordered
	}
	o.late.maybe(ctx, o.stats)
	if pk = o.parkingOf(msg); pk == nil {
		return nil, true, nil
	}
	if err := o.look(ctx, pk); err != nil {
		return nil, false, err
	}
	marked := msg.Metadata.Get(MetadataParked) == "true"
	for probes := 0; onRetry && !pk.parked && (pk.head != nil || marked); probes++ {
		pending, err := o.probe(ctx, pk)
		switch {
		case err != nil:
			return nil, false, err
		case !pending:
			o.stats.stale.Add(1)
			o.logger.Debug("Stale retry copy acked: its event is not parked (released, or parked in a history "+
				"a failover or restore undid), and its key waits for another or was made with KeyOrder", pk.fields())
			return pk, false, nil
		case probes > 0:
			return nil, false, fmt.Errorf("retrytopic: event %s of key %q: its parked row keeps changing", pk.id, pk.key)
		}
		if err := o.look(ctx, pk); err != nil {
			return nil, false, err
		}
	}
	switch {
	case pk.head == nil, pk.parked && onRetry && *pk.head == pk.id:
		return pk, true, nil
	case pk.parked:
		o.logger.Debug("Parked event acked: it waits for its key, or its copy is on the retry path", pk.fields())
		return pk, false, nil
	}
	queued, err := o.wait(ctx, pk, waiting())
	if err != nil {
		return nil, false, err
	}
	if queued {
		o.stats.followed.Add(1)
		o.logger.Debug("Event waits behind its key's parked event", pk.fields())
		return pk, false, nil
	}
	pk.head = nil // released meanwhile: the key is free
	return pk, true, nil
}

// parkingOf is msg's key and event id, nil without either.
func (o *keyOrder) parkingOf(msg *message.Message) *parking {
	key := o.cfg.KeyFunc(msg)
	if key == "" {
		return nil
	}
	id, err := o.cfg.EventIDFunc(msg)
	if err != nil || id == uuid.Nil {
		return nil
	}
	return &parking{group: o.cfg.ConsumerGroup, key: key, id: id}
}

// finish runs after the handler chain returned nil for a message that
// admit let run. A parked event is released (unless ReleaseMiddleware did
// it in the handler's transaction) and its key handed on. A retry-topic
// copy that found no row of its own may have overtaken the transaction
// that parks it: settle waits for that transaction and releases the row it
// committed, or the key would stay parked behind an event that is done.
func (o *keyOrder) finish(ctx context.Context, pk *parking, onRetry bool) error {
	switch {
	case pk == nil:
		return nil
	case pk.parked:
		if !pk.done.Load() {
			if err := o.releaseNow(ctx, pk); err != nil {
				return err
			}
		}
		o.released(pk)
	case onRetry:
		released, err := o.settle(ctx, pk)
		if err != nil {
			return err
		}
		if released {
			o.released(pk)
		}
	}
	return nil
}

// released counts a release of pk, and its hand-off.
func (o *keyOrder) released(pk *parking) {
	o.stats.released.Add(1)
	if pk.handedOff.Load() {
		o.stats.handedOff.Add(1)
	}
}

type releaseKey struct{}

func withRelease(ctx context.Context, pk *parking) context.Context {
	return context.WithValue(ctx, releaseKey{}, pk)
}

// ReleaseMiddleware releases a parked event ([KeyOrder]) in the handler's
// transaction, so the release commits with the event's claim and business
// writes, and with it the hand-off of the key to its next parked event
// (written to the retry path through the outbox, on the same
// transaction): place it inside the dedup middleware, which opens that
// transaction:
//
//	router.AddMiddleware(rt.Middleware, retry.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
//
// In lease mode (idem.Config.Mode = &idem.LeaseConfig{}) the release is registered with
// idem.Complete and commits with the completion. Without it (or when the
// claim shows a duplicate and the handler does not run) [RetryTopic.Middleware] releases the event in a transaction of its
// own after the handler chain returned nil, before the ack: a crash in
// between leaves the key parked until the redelivery, which the claim
// absorbs and which releases it. Without KeyOrder it only calls h.
func (r *RetryTopic) ReleaseMiddleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		pk, _ := ctx.Value(releaseKey{}).(*parking)
		if r.order == nil || pk == nil {
			return h(msg)
		}
		pk.done.Store(false)
		pk.handedOff.Store(false)
		tx, ok := idem.TxFromContext(ctx)
		produced, err := h(msg)
		if err != nil {
			return produced, err
		}
		release := func(ctx context.Context, tx pgx.Tx) error {
			if err := r.order.release(ctx, tx, pk); err != nil {
				return err
			}
			pk.done.Store(true)
			return nil
		}
		if !ok {
			// Lease mode: the release joins the completing transaction,
			// with the claim (a lost lease or a duplicate runs nothing, and
			// RetryTopic.Middleware releases on its own).
			_ = idem.Complete(ctx, release)
			return produced, nil
		}
		if err := release(ctx, tx); err != nil {
			return nil, err
		}
		return produced, nil
	}
}
