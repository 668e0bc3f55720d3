package retrytopic

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
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

// keyOrder keeps the parked-keys table of [KeyOrder]. A key's parked events
// are its rows, in seq order; the first ("head") is the only one with a copy
// on the retry path (topic and not_before set). The others wait with their
// message (topic NULL) until the head is released: the release, in the
// transaction that deletes the head's row, hands the key to the next row
// and writes that event to handoffTopic through the outbox. Parking behind
// a head and handing off both lock the key's head row (lockHead), so a
// follower is never parked behind a head that a concurrent release has just
// deleted without handing the key on.
type keyOrder struct {
	cfg          KeyOrder
	handoffTopic string
	now          func() time.Time
}

// action is what the middleware does with a keyed message.
type action int

const (
	// actRun: run the handler (the key is free, or the message is its head).
	actRun action = iota
	// actAck: the event is parked already (it waits in the table, or its
	// copy is on the retry path): ack without running.
	actAck
	// actWait: park the event behind its key's head, with its message,
	// then ack; run it if the key turns out to be free.
	actWait
	// actStore: a copy of a parked event that waits without its message (a
	// row written before the table kept messages): store the message, ack.
	actStore
	// actProbe: a retry-topic copy of an event without a row, its key
	// parked by another event: wait for a transaction that may be parking
	// it (then look again), else the copy is stale, ack it.
	actProbe
)

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

func (o *keyOrder) table() string { return ident.Quote(o.cfg.Table.Schema, o.cfg.Table.Table) }

// checker is implemented by *outbox.Outbox: it verifies a topic's table.
type checker interface {
	Check(ctx context.Context, db migrate.Beginner, topics ...string) error
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

// look reads msg's key's head and whether msg itself is parked, and tells
// what to do with msg. A message without a key or a usable event id is never
// held back (pk nil): the dedup middleware refuses an unusable id anyway.
//
// On the main topic a parked event is acked (it waits in the table or its
// copy is on the retry path) and any other event of a parked key waits
// behind the head. On a retry topic the head runs, and so does a copy
// whose key is free (the dedup claim decides; see settle); a copy of
// another parked event is acked (its row keeps it); a copy of an event
// without a row while its key is parked by another is probed (see probe).
func (o *keyOrder) look(ctx context.Context, msg *message.Message, onRetry bool) (pk *parking, act action, err error) {
	key := o.cfg.KeyFunc(msg)
	if key == "" {
		return nil, actRun, nil
	}
	id, err := o.cfg.EventIDFunc(msg)
	if err != nil || id == uuid.Nil {
		return nil, actRun, nil
	}
	pk = &parking{group: o.cfg.ConsumerGroup, key: key, id: id}
	var head uuid.UUID
	var noMessage bool
	err = o.queryRow(ctx, `SELECT h.event_id, me.event_id IS NOT NULL, me.event_id IS NOT NULL AND me.payload IS NULL
FROM `+o.table()+` h LEFT JOIN `+o.table()+` me ON me.consumer_group = $1 AND me.partition_key = $2 AND me.event_id = $3
WHERE h.consumer_group = $1 AND h.partition_key = $2 ORDER BY h.seq LIMIT 1`,
		[]any{pk.group, pk.key, pk.id}, &head, &pk.parked, &noMessage)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return pk, actRun, nil
	case err != nil:
		return nil, actRun, fmt.Errorf("retrytopic: look up parked key: %w", err)
	}
	pk.head = &head
	switch {
	case !pk.parked && onRetry:
		return pk, actProbe, nil
	case !pk.parked:
		return pk, actWait, nil
	case !onRetry:
		return pk, actAck, nil
	case head == id:
		return pk, actRun, nil
	case noMessage:
		return pk, actStore, nil
	default:
		return pk, actAck, nil
	}
}

// headRow is a key's first parked event, locked.
type headRow struct {
	id       uuid.UUID
	waiting  bool // no copy on the retry path (topic NULL)
	msgUUID  *string
	payload  []byte
	metadata []byte
}

// lockHead locks and returns the key's first parked event (nil when the
// key has none). A head deleted by a transaction that committed while this
// one waited for its lock is skipped for the next row; a row parked by a
// transaction that committed after this statement's snapshot is not seen
// by it, so an empty answer is checked again in a fresh statement.
func (o *keyOrder) lockHead(ctx context.Context, tx pgx.Tx, group, key string) (*headRow, error) {
	for {
		var h headRow
		err := tx.QueryRow(ctx, `SELECT event_id, topic IS NULL, message_uuid, payload, metadata FROM `+o.table()+`
WHERE consumer_group = $1 AND partition_key = $2 ORDER BY seq LIMIT 1 FOR UPDATE`, group, key).
			Scan(&h.id, &h.waiting, &h.msgUUID, &h.payload, &h.metadata)
		if err == nil {
			return &h, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("retrytopic: lock parked key: %w", err)
		}
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+o.table()+` WHERE consumer_group = $1 AND partition_key = $2)`, group, key).Scan(&exists); err != nil {
			return nil, fmt.Errorf("retrytopic: lock parked key: %w", err)
		}
		if !exists {
			return nil, nil
		}
	}
}

// storedMessage is what a parked row keeps of a message.
func storedMessage(c *message.Message) (uuid string, payload, metadata []byte, err error) {
	md, err := json.Marshal(map[string]string(c.Metadata))
	if err != nil {
		return "", nil, nil, fmt.Errorf("retrytopic: encode metadata: %w", err)
	}
	payload = c.Payload
	if payload == nil {
		payload = []byte{}
	}
	return c.UUID, payload, md, nil
}

// message rebuilds a parked row's message.
func (h *headRow) message() (*message.Message, error) {
	var md map[string]string
	if err := json.Unmarshal(h.metadata, &md); err != nil {
		return nil, fmt.Errorf("retrytopic: decode parked metadata of event %s: %w", h.id, err)
	}
	u := ""
	if h.msgUUID != nil {
		u = *h.msgUUID
	}
	m := message.NewMessage(u, h.payload)
	for k, v := range md {
		m.Metadata.Set(k, v)
	}
	return m, nil
}

// wait parks pk's event behind its key's head with its message c, in a
// transaction of its own that locks the head first; queued is false (and
// nothing is written) when the key has no parked event any more: the
// caller runs the event.
func (o *keyOrder) wait(ctx context.Context, pk *parking, c *message.Message) (queued bool, err error) {
	u, payload, md, err := storedMessage(c)
	if err != nil {
		return false, err
	}
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		h, err := o.lockHead(ctx, tx, pk.group, pk.key)
		if err != nil || h == nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id, message_uuid, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (consumer_group, partition_key, event_id) DO NOTHING`,
			pk.group, pk.key, pk.id, u, payload, md); err != nil {
			return fmt.Errorf("retrytopic: park behind key: %w", err)
		}
		queued = true
		if testHookWaitBeforeCommit != nil {
			testHookWaitBeforeCommit(pk.id)
		}
		return nil
	})
	return queued, err
}

// testHookWaitBeforeCommit, set by tests, runs in wait between the INSERT
// and the COMMIT.
var testHookWaitBeforeCommit func(id uuid.UUID)

// store keeps c as the message of pk's parked event, which has none (it was
// parked before the table kept messages, and its copy came back); the
// event then waits without a copy on the retry path. If it has become its
// key's head meanwhile, it is handed off at once.
func (o *keyOrder) store(ctx context.Context, pk *parking, c *message.Message) error {
	u, payload, md, err := storedMessage(c)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		if _, err := o.lockHead(ctx, tx, pk.group, pk.key); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE `+o.table()+` SET message_uuid = $4, payload = $5, metadata = $6, topic = NULL, not_before = NULL
WHERE consumer_group = $1 AND partition_key = $2 AND event_id = $3 AND payload IS NULL`, pk.group, pk.key, pk.id, u, payload, md); err != nil {
			return fmt.Errorf("retrytopic: store parked message: %w", err)
		}
		_, err := o.handOff(ctx, tx, pk.group, pk.key)
		return err
	})
}

// park records pk's event as its key's head, its copy c at topic until
// notBefore, and runs publish, in one transaction that commits only after
// publish succeeded: a committed head always has its copy on a retry
// topic. If another event of the key is parked first (the key was parked
// while this one ran), the event waits behind it with its copy instead
// and nothing is published (queued is true).
func (o *keyOrder) park(ctx context.Context, pk *parking, topic string, notBefore time.Time, c *message.Message, publish func() error) (queued bool, err error) {
	u, payload, md, err := storedMessage(c)
	if err != nil {
		return false, err
	}
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		queued = false
		h, err := o.lockHead(ctx, tx, pk.group, pk.key)
		if err != nil {
			return err
		}
		if h != nil && h.id != pk.id {
			if _, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id, message_uuid, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (consumer_group, partition_key, event_id) DO NOTHING`,
				pk.group, pk.key, pk.id, u, payload, md); err != nil {
				return fmt.Errorf("retrytopic: park behind key: %w", err)
			}
			queued = true
			return nil
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (consumer_group, partition_key, event_id) DO UPDATE SET topic = EXCLUDED.topic, not_before = EXCLUDED.not_before,
	message_uuid = EXCLUDED.message_uuid, payload = EXCLUDED.payload, metadata = EXCLUDED.metadata`,
			pk.group, pk.key, pk.id, topic, notBefore, u, payload, md); err != nil {
			return fmt.Errorf("retrytopic: park key: %w", err)
		}
		return publish()
	})
	return queued, err
}

// handOff gives a key whose head waits in the table (its event before it
// was released) to that head: its message goes to the hand-off topic
// through the outbox on tx, due at once, and its row records the copy.
// It reports whether it handed off.
func (o *keyOrder) handOff(ctx context.Context, tx pgx.Tx, group, key string) (bool, error) {
	h, err := o.lockHead(ctx, tx, group, key)
	if err != nil || h == nil || !h.waiting {
		return false, err
	}
	if h.payload == nil {
		// Parked before the table kept messages: its copy is on the retry
		// path already.
		return false, nil
	}
	if err := o.writeCopy(ctx, tx, group, key, h, o.handoffTopic); err != nil {
		return false, err
	}
	return true, nil
}

// writeCopy writes h's stored message to topic through the outbox on tx,
// due now, and records the copy in h's row.
func (o *keyOrder) writeCopy(ctx context.Context, tx pgx.Tx, group, key string, h *headRow, topic string) error {
	m, err := h.message()
	if err != nil {
		return err
	}
	now := o.now()
	m.Metadata.Set(MetadataNotBefore, now.UTC().Format(time.RFC3339Nano))
	if _, err := tx.Exec(ctx, `UPDATE `+o.table()+` SET topic = $4, not_before = $5 WHERE consumer_group = $1 AND partition_key = $2 AND event_id = $3`,
		group, key, h.id, topic, now); err != nil {
		return fmt.Errorf("retrytopic: hand off parked key: %w", err)
	}
	// Without the handler's context values: the outbox must not stamp the
	// released event with the causation or trace of the event before it.
	if err := o.cfg.Outbox.PublishInTx(valuesHidden{ctx}, tx, topic, m); err != nil {
		return fmt.Errorf("retrytopic: hand off parked key: write event %s to the outbox for %s: %w", h.id, topic, err)
	}
	return nil
}

// valuesHidden is a context that keeps its parent's deadline and
// cancellation but none of its values.
type valuesHidden struct{ context.Context }

func (valuesHidden) Value(any) any { return nil }

type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// queryRow scans one row, straight on DB when it can query (a pool, a conn,
// a tx: one round trip), else in a read transaction.
func (o *keyOrder) queryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	if q, ok := o.cfg.DB.(rowQuerier); ok {
		return q.QueryRow(ctx, sql, args...).Scan(dest...)
	}
	tx, err := o.cfg.DB.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return tx.QueryRow(ctx, sql, args...).Scan(dest...)
}

// release deletes pk's row on tx (the handler's transaction, or one of its
// own) and hands the key to the next parked event.
func (o *keyOrder) release(ctx context.Context, tx pgx.Tx, pk *parking) error {
	if _, err := tx.Exec(ctx, `DELETE FROM `+o.table()+` WHERE consumer_group = $1 AND partition_key = $2 AND event_id = $3`, pk.group, pk.key, pk.id); err != nil {
		return fmt.Errorf("retrytopic: release parked key: %w", err)
	}
	handed, err := o.handOff(ctx, tx, pk.group, pk.key)
	if err != nil {
		return err
	}
	pk.handedOff.Store(handed)
	return nil
}

// releaseNow releases pk in a transaction of its own.
func (o *keyOrder) releaseNow(ctx context.Context, pk *parking) error {
	return pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error { return o.release(ctx, tx, pk) })
}

// releaseUnlessDone releases pk on its own, unless ReleaseMiddleware
// already did in the handler's transaction: after a duplicate (the handler
// did not run), or without ReleaseMiddleware in the chain.
func (o *keyOrder) releaseUnlessDone(ctx context.Context, pk *parking) error {
	if pk.done.Load() {
		return nil
	}
	return o.releaseNow(ctx, pk)
}

// probe tells whether a retry-topic copy that found no row of its own is
// being parked right now: park inserts the row before it publishes the
// copy and commits after, so the probe INSERT waits on the primary key for
// that transaction. pending is true when it committed the row (look
// again); false when there is none: the copy is stale. Its event was
// released (applied, poisoned, or skipped by Unblock) and this is a second
// copy of it (a hand-off the forwarder sent again, a copy redelivered after
// a crash), or its park was rolled back and the message it was made from
// is redelivered instead (a park commits before that message is acked).
func (o *keyOrder) probe(ctx context.Context, pk *parking) (pending bool, err error) {
	tx, err := o.cfg.DB.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("retrytopic: probe parked key: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // the probe's row goes
	tag, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id)
VALUES ($1, $2, $3) ON CONFLICT (consumer_group, partition_key, event_id) DO NOTHING`, pk.group, pk.key, pk.id)
	if err != nil {
		return false, fmt.Errorf("retrytopic: probe parked key: %w", err)
	}
	return tag.RowsAffected() == 0, nil
}

// settle releases pk's row after a copy that found none succeeded. park
// publishes the copy before it commits the row, so the copy can be consumed
// while the row is still uncommitted, invisible to look. The probe INSERT
// waits on the primary key for such a transaction to end; when it
// committed, the probe inserts nothing and the release removes the
// committed row (released is true) and hands the key on; otherwise the
// release removes the probe's own row.
func (o *keyOrder) settle(ctx context.Context, pk *parking) (released bool, err error) {
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id)
VALUES ($1, $2, $3) ON CONFLICT (consumer_group, partition_key, event_id) DO NOTHING`, pk.group, pk.key, pk.id)
		if err != nil {
			return fmt.Errorf("retrytopic: settle parked key: %w", err)
		}
		released = tag.RowsAffected() == 0
		return o.release(ctx, tx, pk)
	})
	return released && err == nil, err
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
// In lease mode (idem.Config.Lease) the release is registered with
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
		if !ok {
			// Lease mode: the release joins the completing transaction,
			// with the claim (a lost lease or a duplicate runs nothing, and
			// RetryTopic.Middleware releases on its own).
			_ = idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
				if err := r.order.release(ctx, tx, pk); err != nil {
					return err
				}
				pk.done.Store(true)
				return nil
			})
			return produced, nil
		}
		if err := r.order.release(ctx, tx, pk); err != nil {
			return nil, err
		}
		pk.done.Store(true)
		return produced, nil
	}
}
