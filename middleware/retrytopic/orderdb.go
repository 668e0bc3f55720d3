package retrytopic

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// statements are the statements of [keyOrder] on its parked-keys table,
// each written once. $1, $2 and $3 are the consumer group, the key and
// the event id wherever they appear.
type statements struct {
	// look: the key's first event, and whether event $3 has a row.
	look string
	// lockHead: the key's first event, locked, with its message.
	lockHead string
	// anyRow: whether the key has a row.
	anyRow string
	// insertWaiting: event $3 waits behind the key's first event with its
	// message ($4 UUID, $5 payload, $6 metadata), no copy on the retry path.
	insertWaiting string
	// insertHead: event $3 with its copy at topic $4 until $5, and its
	// message ($6 UUID, $7 payload, $8 metadata).
	insertHead string
	// insertBare: a row without a message, which the same transaction
	// rolls back or deletes (probe, settle); nothing when the row exists.
	insertBare string
	// setCopy: event $3's copy is at topic $4, due at $5.
	setCopy string
	// copyTopic: the topic of event $3's copy, "" when it has none.
	copyTopic string
	// remove: event $3's row goes.
	remove string
	// overdue: the keys of group $1 whose first event's copy has been due
	// for more than $2 seconds (their count, and the most overdue one).
	overdue string
}

func newStatements(table string) statements {
	const event = ` WHERE consumer_group = $1 AND partition_key = $2 AND event_id = $3`
	const onConflict = ` ON CONFLICT (consumer_group, partition_key, event_id)`
	return statements{
		look: `SELECT h.event_id, me.event_id IS NOT NULL
FROM ` + table + ` h LEFT JOIN ` + table + ` me ON me.consumer_group = $1 AND me.partition_key = $2 AND me.event_id = $3
WHERE h.consumer_group = $1 AND h.partition_key = $2 ORDER BY h.seq LIMIT 1`,
		lockHead: `SELECT event_id, topic IS NULL, message_uuid, payload, metadata FROM ` + table + `
WHERE consumer_group = $1 AND partition_key = $2 ORDER BY seq LIMIT 1 FOR UPDATE`,
		anyRow: `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer_group = $1 AND partition_key = $2)`,
		insertWaiting: `INSERT INTO ` + table + ` (consumer_group, partition_key, event_id, message_uuid, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6)` + onConflict + ` DO NOTHING`,
		insertHead: `INSERT INTO ` + table + ` (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)` + onConflict + ` DO UPDATE SET topic = EXCLUDED.topic, not_before = EXCLUDED.not_before,
	message_uuid = EXCLUDED.message_uuid, payload = EXCLUDED.payload, metadata = EXCLUDED.metadata`,
		insertBare: `INSERT INTO ` + table + ` (consumer_group, partition_key, event_id) VALUES ($1, $2, $3)` + onConflict + ` DO NOTHING`,
		setCopy:    `UPDATE ` + table + ` SET topic = $4, not_before = $5` + event,
		copyTopic:  `SELECT COALESCE(topic, '') FROM ` + table + event,
		remove:     `DELETE FROM ` + table + event,
		overdue: `WITH h AS (
	SELECT DISTINCT ON (partition_key) partition_key, event_id, topic, not_before
	FROM ` + table + ` WHERE consumer_group = $1 ORDER BY partition_key, seq
), late AS (
	SELECT * FROM h WHERE topic IS NOT NULL AND not_before < now() - make_interval(secs => $2)
)
SELECT (SELECT count(*) FROM late), l.partition_key, l.topic, l.event_id::text, extract(epoch FROM now() - l.not_before)::float8
FROM (SELECT 1) one LEFT JOIN (SELECT * FROM late ORDER BY not_before LIMIT 1) l ON true`,
	}
}

// look reads pk's key's first event into pk.head (nil when the key is
// free) and whether pk's event has a row.
func (o *keyOrder) look(ctx context.Context, pk *parking) error {
	var head uuid.UUID
	err := o.queryRow(ctx, o.sql.look, []any{pk.group, pk.key, pk.id}, &head, &pk.parked)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		pk.head, pk.parked = nil, false
		return nil
	case err != nil:
		return fmt.Errorf("retrytopic: look up parked key: %w", err)
	}
	pk.head = &head
	return nil
}

// queryRow scans one row, straight on DB when it can query (a pool, a conn,
// a tx: one round trip), else in a read transaction.
func (o *keyOrder) queryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	if q, ok := o.cfg.DB.(dbx.Querier); ok {
		return q.QueryRow(ctx, sql, args...).Scan(dest...)
	}
	tx, err := o.cfg.DB.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return tx.QueryRow(ctx, sql, args...).Scan(dest...)
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
		err := tx.QueryRow(ctx, o.sql.lockHead, group, key).Scan(&h.id, &h.waiting, &h.msgUUID, &h.payload, &h.metadata)
		if err == nil {
			return &h, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("retrytopic: lock parked key: %w", err)
		}
		var exists bool
		if err := tx.QueryRow(ctx, o.sql.anyRow, group, key).Scan(&exists); err != nil {
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

// insertWaiting parks pk's event behind its key's first event on tx, with
// its message c.
func (o *keyOrder) insertWaiting(ctx context.Context, tx pgx.Tx, pk *parking, c *message.Message) error {
	u, payload, md, err := storedMessage(c)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, o.sql.insertWaiting, pk.group, pk.key, pk.id, u, payload, md); err != nil {
		return fmt.Errorf("retrytopic: park behind key: %w", err)
	}
	return nil
}

// wait parks pk's event behind its key's head with its message c, in a
// transaction of its own that locks the head first; queued is false (and
// nothing is written) when the key has no parked event any more: the
// caller runs the event.
func (o *keyOrder) wait(ctx context.Context, pk *parking, c *message.Message) (queued bool, err error) {
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		h, err := o.lockHead(ctx, tx, pk.group, pk.key)
		if err != nil || h == nil {
			return err
		}
		if err := o.insertWaiting(ctx, tx, pk, c); err != nil {
			return err
		}
		queued = true
		o.step(stepWaitInserted, pk.id)
		return nil
	})
	return queued, err
}

// park records pk's event as its key's head, its copy c at topic until
// notBefore, and runs publish, in one transaction that commits only after
// publish succeeded: a committed head always has its copy on a retry
// topic. If another event of the key is parked first (the key was parked
// while this one ran), the event waits behind it with its copy instead
// and nothing is published (queued is true).
func (o *keyOrder) park(ctx context.Context, pk *parking, topic string, notBefore time.Time, c *message.Message, publish func() error) (queued bool, err error) {
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		h, err := o.lockHead(ctx, tx, pk.group, pk.key)
		if err != nil {
			return err
		}
		queued = h != nil && h.id != pk.id
		if queued {
			return o.insertWaiting(ctx, tx, pk, c)
		}
		u, payload, md, err := storedMessage(c)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, o.sql.insertHead, pk.group, pk.key, pk.id, topic, notBefore, u, payload, md); err != nil {
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
	if _, err := tx.Exec(ctx, o.sql.setCopy, group, key, h.id, topic, now); err != nil {
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

// release deletes pk's row on tx (the handler's transaction, or one of its
// own) and hands the key to the next parked event.
func (o *keyOrder) release(ctx context.Context, tx pgx.Tx, pk *parking) error {
	if _, err := tx.Exec(ctx, o.sql.remove, pk.group, pk.key, pk.id); err != nil {
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
	tag, err := tx.Exec(ctx, o.sql.insertBare, pk.group, pk.key, pk.id)
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
		tag, err := tx.Exec(ctx, o.sql.insertBare, pk.group, pk.key, pk.id)
		if err != nil {
			return fmt.Errorf("retrytopic: settle parked key: %w", err)
		}
		released = tag.RowsAffected() == 0
		return o.release(ctx, tx, pk)
	})
	return released && err == nil, err
}
