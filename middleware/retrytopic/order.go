package retrytopic

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// DefaultKeyFunc is the default [KeyOrder.KeyFunc]: the partition_key
// metadata (publisher.MetadataPartitionKey, which the library's Kafka
// marshaler turns into the record key), else the Kafka record key of the
// consumed message.
func DefaultKeyFunc(msg *message.Message) string {
	if k := msg.Metadata.Get(publisher.MetadataPartitionKey); k != "" {
		return k
	}
	if k, ok := kafka.MessageKeyFromCtx(msg.Context()); ok {
		return string(k)
	}
	return ""
}

type keyOrder struct {
	cfg KeyOrder
}

// parking is a keyed message's place in the parked-keys table.
type parking struct {
	group, key string
	id         uuid.UUID
	// parked: the event has a row (it is on the retry path).
	parked bool
	// head is the key's first parked event, nil when the key is free.
	head *parkedHead
	// done: ReleaseMiddleware released it in the handler's transaction.
	done atomic.Bool
}

type parkedHead struct {
	id        uuid.UUID
	topic     string
	notBefore time.Time
}

func (p *parking) fields() watermill.LogFields {
	f := watermill.LogFields{"event_id": p.id.String(), "consumer_group": p.group}
	if p.head != nil {
		f["parked_head"] = p.head.id.String()
	}
	return f
}

func (o *keyOrder) table() string { return ident.Quote(o.cfg.Table.Schema, o.cfg.Table.Table) }

// check refuses a parked-keys table with pending migrations.
func (o *keyOrder) check(ctx context.Context) error {
	m, err := NewMigrator(o.cfg.DB, o.cfg.Table)
	if err != nil {
		return err
	}
	res, err := m.Validate(ctx)
	if err != nil {
		return err
	}
	if !res.OK {
		return notMigrated(o.cfg.Table, res.Pending)
	}
	return nil
}

// look reads msg's key's first parked event and whether msg itself is
// parked, and tells whether msg must follow that event instead of running.
// A message without a key or a usable event id is never held back (pk nil):
// the dedup middleware refuses an unusable id anyway.
func (o *keyOrder) look(ctx context.Context, msg *message.Message, onRetry bool) (pk *parking, follow bool, err error) {
	key := o.cfg.KeyFunc(msg)
	if key == "" {
		return nil, false, nil
	}
	id, err := o.cfg.EventIDFunc(msg)
	if err != nil || id == uuid.Nil {
		return nil, false, nil
	}
	pk = &parking{group: o.cfg.ConsumerGroup, key: key, id: id}
	var h parkedHead
	err = o.queryRow(ctx, `SELECT h.event_id, h.topic, h.not_before,
	EXISTS (SELECT 1 FROM `+o.table()+` p WHERE p.consumer_group = $1 AND p.partition_key = $2 AND p.event_id = $3)
FROM `+o.table()+` h WHERE h.consumer_group = $1 AND h.partition_key = $2 ORDER BY h.seq LIMIT 1`,
		[]any{pk.group, pk.key, pk.id}, &h.id, &h.topic, &h.notBefore, &pk.parked)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return pk, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("retrytopic: look up parked key: %w", err)
	}
	pk.head = &h
	if onRetry {
		return pk, h.id != id, nil
	}
	// On the main topic a parked event is already on the retry path (the
	// caller acks it); any other event of a parked key follows.
	return pk, !pk.parked, nil
}

// park records pk's event as parked, its copy at topic until notBefore,
// and runs publish, in one transaction that commits only after publish
// succeeded: a committed row always has its copy on a retry topic.
func (o *keyOrder) park(ctx context.Context, pk *parking, topic string, notBefore time.Time, publish func() error) error {
	err := pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id, topic, not_before)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer_group, partition_key, event_id) DO UPDATE SET topic = EXCLUDED.topic, not_before = EXCLUDED.not_before`,
			pk.group, pk.key, pk.id, topic, notBefore); err != nil {
			return fmt.Errorf("retrytopic: park key: %w", err)
		}
		return publish()
	})
	return err
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

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

// release deletes pk's row with e (the handler's transaction).
func (o *keyOrder) release(ctx context.Context, e execer, pk *parking) error {
	_, err := e.Exec(ctx, `DELETE FROM `+o.table()+` WHERE consumer_group = $1 AND partition_key = $2 AND event_id = $3`, pk.group, pk.key, pk.id)
	if err != nil {
		return fmt.Errorf("retrytopic: release parked key: %w", err)
	}
	return nil
}

// releaseNow deletes pk's row on its own: one statement on DB when it can
// execute one (a pool, a conn), else in a transaction.
func (o *keyOrder) releaseNow(ctx context.Context, pk *parking) error {
	if e, ok := o.cfg.DB.(execer); ok {
		return o.release(ctx, e, pk)
	}
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

// settle releases pk's row after a copy that found none succeeded. park
// publishes the copy before it commits the row, so the copy can be consumed
// while the row is still uncommitted, invisible to look. The probe INSERT
// waits on the primary key for such a transaction to end; when it
// committed, the probe inserts nothing and the DELETE removes the committed
// row (released is true); otherwise the DELETE removes the probe's own row.
func (o *keyOrder) settle(ctx context.Context, pk *parking) (released bool, err error) {
	err = pgx.BeginFunc(ctx, o.cfg.DB, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (consumer_group, partition_key, event_id, topic, not_before)
VALUES ($1, $2, $3, '', now()) ON CONFLICT (consumer_group, partition_key, event_id) DO NOTHING`, pk.group, pk.key, pk.id)
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
// writes: place it inside the dedup middleware, which opens that
// transaction:
//
//	router.AddMiddleware(rt.Middleware, retry.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
//
// Without it (or when the claim shows a duplicate and the handler does not
// run) [RetryTopic.Middleware] releases the event in a transaction of its
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
		tx, ok := idem.TxFromContext(ctx)
		produced, err := h(msg)
		if err != nil || !ok {
			return produced, err
		}
		if err := r.order.release(ctx, tx, pk); err != nil {
			return nil, err
		}
		pk.done.Store(true)
		return produced, nil
	}
}

// ParkedEvent is one row of the parked-keys table.
type ParkedEvent struct {
	ConsumerGroup string    `json:"consumer_group"`
	Key           string    `json:"key"`
	EventID       uuid.UUID `json:"event_id"`
	// Seq orders the events of a key: the lowest is the one the others follow.
	Seq int64 `json:"seq"`
	// Topic and NotBefore tell where the event's latest copy waits.
	Topic     string    `json:"topic"`
	NotBefore time.Time `json:"not_before"`
	ParkedAt  time.Time `json:"parked_at"`
}

// Querier runs a query: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ListParked returns the parked events of consumerGroup (of every group
// when ""), by key and in order. A key parked for long means its first
// event's copy is not coming back (its retry topic's retention ran out, or
// no retry consumer runs); see docs/retry.md.
func ListParked(ctx context.Context, db Querier, t ParkedKeysTable, consumerGroup string) ([]ParkedEvent, error) {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return nil, fmt.Errorf("retrytopic: %w", err)
	}
	if err := deduplicator.ValidateGroupName("consumerGroup", consumerGroup); err != nil {
		return nil, fmt.Errorf("retrytopic: %w", err)
	}
	rows, err := db.Query(ctx, `SELECT consumer_group, partition_key, event_id, seq, topic, not_before, parked_at
FROM `+ident.Quote(t.Schema, t.Table)+` WHERE $1 = '' OR consumer_group = $1
ORDER BY consumer_group, partition_key, seq`, consumerGroup)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: list parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedEvent, error) {
		var p ParkedEvent
		err := row.Scan(&p.ConsumerGroup, &p.Key, &p.EventID, &p.Seq, &p.Topic, &p.NotBefore, &p.ParkedAt)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("retrytopic: list parked keys: %w", err)
	}
	return out, nil
}
