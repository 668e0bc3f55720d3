package retrytopic

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Step is a point of a KeyOrder transaction where a test can pause it.
type Step = step

// The steps of SetHook.
const (
	// StepWaitInserted: a follower's row is inserted behind its key's
	// first event, before the COMMIT.
	StepWaitInserted = stepWaitInserted
)

// SetHook makes r's KeyOrder call hook at each step, with the event id
// (nil removes it); call it before r handles messages.
func SetHook(r *RetryTopic, hook func(s Step, id uuid.UUID)) { r.order.hook = hook }

// Wait parks event id of key behind its key's head, as a main-topic
// follower does: queued is false when the key is free.
func Wait(ctx context.Context, r *RetryTopic, key string, id uuid.UUID, msg *message.Message) (bool, error) {
	return r.order.wait(ctx, &parking{group: r.order.cfg.ConsumerGroup, key: key, id: id}, msg)
}

// ReleaseTx releases event id of key on tx, as ReleaseMiddleware does in
// the handler's transaction, and reports whether it handed the key on.
func ReleaseTx(ctx context.Context, r *RetryTopic, tx pgx.Tx, key string, id uuid.UUID) (bool, error) {
	pk := &parking{group: r.order.cfg.ConsumerGroup, key: key, id: id}
	err := r.order.release(ctx, tx, pk)
	return pk.handedOff.Load(), err
}

// IsRetryTopic reports whether topic is one of r's retry topics.
func IsRetryTopic(r *RetryTopic, topic string) bool { return r.isRetryTopic(topic) }

// ParkedEvent is one row of the parked-keys table, for the tests.
type ParkedEvent struct {
	ConsumerGroup string    `json:"consumer_group"`
	Key           string    `json:"key"`
	EventID       uuid.UUID `json:"event_id"`
	// Seq orders the events of a key: the lowest is the one the others
	// wait for.
	Seq int64 `json:"seq"`
	// Topic and NotBefore tell where the event's copy waits on the retry
	// path. Topic is "" while the event waits in the table, behind the
	// first event of its key.
	Topic     string    `json:"topic"`
	NotBefore time.Time `json:"not_before"`
	ParkedAt  time.Time `json:"parked_at"`
}

// ListParked returns the parked events of consumerGroup (of every group
// when ""), by key and in order, for the tests.
func ListParked(ctx context.Context, db migrate.DBTX, t ParkedKeysTable, consumerGroup string) ([]ParkedEvent, error) {
	if err := checkParkedArgs(&t, consumerGroup); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, `SELECT consumer_group, partition_key, event_id, seq, COALESCE(topic, ''), not_before, parked_at
FROM `+ident.Quote(t.Schema, t.Table)+` WHERE $1 = '' OR consumer_group = $1
ORDER BY consumer_group, partition_key, seq`, consumerGroup)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: list parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedEvent, error) {
		var p ParkedEvent
		var nb *time.Time
		err := row.Scan(&p.ConsumerGroup, &p.Key, &p.EventID, &p.Seq, &p.Topic, &nb, &p.ParkedAt)
		if nb != nil {
			p.NotBefore = *nb
		}
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("retrytopic: list parked keys: %w", err)
	}
	return out, nil
}
