package retrytopic

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// checkParkedArgs validates the table and the consumer group the parked-keys
// functions take.
func checkParkedArgs(t *ParkedKeysTable, consumerGroup string) error {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	if err := deduplicator.ValidateGroupName("consumerGroup", consumerGroup); err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	return nil
}

// UnblockOpts tells [Unblock] what to do with a key's first event.
type UnblockOpts struct {
	// Skip removes the first event instead of sending it again: the next
	// event of the key is handed off at once. The removed event is neither
	// applied nor poisoned (UnblockResult.Head names it): replay or
	// republish it (same event_id: the claim keeps it safe). Defaults to
	// false: send it again.
	Skip bool
	// Topic is the retry topic the copy goes to: a retry topic of the
	// group's retry consumers with an outbox table. Defaults to the topic
	// of the first event's copy that did not come back.
	Topic string
}

// UnblockResult is what [Unblock] did.
type UnblockResult struct {
	// Head is the key's first event.
	Head uuid.UUID `json:"head"`
	// Topic is where the copy went.
	Topic string `json:"topic"`
	// Resent: Head's stored message was written to Topic again, due now.
	Resent bool `json:"resent"`
	// Skipped: Head's row was removed.
	Skipped bool `json:"skipped"`
	// HandedOff is the event the key was handed to after a skip (nil when
	// none waited).
	HandedOff *uuid.UUID `json:"handed_off,omitempty"`
}

// Unblock gets a parked key moving again when its first event's copy is
// not coming back (its retry topic's retention ran out, the topic was
// recreated, no retry consumer ran): in one transaction on db it sends
// that event's stored message to the retry path again, through ob (the
// outbox of the retry consumers' [KeyOrder]), or with opts.Skip removes it
// and hands the key to the next event. A copy that does come back after
// all is absorbed: the event's claim decides, and the key's order holds
// because only the key's first event runs. It returns [ErrKeyNotParked]
// when the key has no parked event.
func Unblock(ctx context.Context, db migrate.Beginner, ob idem.OutboxWriter, t ParkedKeysTable, consumerGroup, key string, opts *UnblockOpts) (*UnblockResult, error) {
	if opts == nil {
		opts = &UnblockOpts{}
	}
	switch {
	case db == nil:
		return nil, errors.New("retrytopic: Unblock: db: required")
	case ob == nil:
		return nil, errors.New("retrytopic: Unblock: ob: required")
	case consumerGroup == "":
		return nil, errors.New("retrytopic: Unblock: consumerGroup: required")
	case key == "":
		return nil, errors.New("retrytopic: Unblock: key: required")
	}
	if err := checkParkedArgs(&t, consumerGroup); err != nil {
		return nil, err
	}
	o := newKeyOrder(KeyOrder{DB: db, ConsumerGroup: consumerGroup, Table: t, Outbox: ob}, "", time.Now, nil, nil)
	res := &UnblockResult{}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		*res = UnblockResult{}
		return o.unblock(ctx, tx, key, opts, res)
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

// unblock is [Unblock] on tx.
func (o *keyOrder) unblock(ctx context.Context, tx pgx.Tx, key string, opts *UnblockOpts, res *UnblockResult) error {
	group := o.cfg.ConsumerGroup
	h, err := o.lockHead(ctx, tx, group, key)
	if err != nil {
		return err
	}
	if h == nil {
		return fmt.Errorf("retrytopic: Unblock: %w: %s in group %s", ErrKeyNotParked, key, group)
	}
	res.Head = h.id
	topic := opts.Topic
	if topic == "" {
		if err := tx.QueryRow(ctx, o.sql.copyTopic, group, key, h.id).Scan(&topic); err != nil {
			return fmt.Errorf("retrytopic: Unblock: %w", err)
		}
		if topic == "" {
			return fmt.Errorf("retrytopic: Unblock: the first event of %s has no copy yet: name the retry topic (UnblockOpts.Topic)", key)
		}
	}
	res.Topic = topic
	o.handoffTopic = topic
	if !opts.Skip {
		res.Resent = true
		return o.writeCopy(ctx, tx, group, key, h, topic)
	}
	pk := &parking{group: group, key: key, id: h.id}
	if err := o.release(ctx, tx, pk); err != nil {
		return err
	}
	res.Skipped = true
	if pk.handedOff.Load() {
		next, err := o.lockHead(ctx, tx, group, key)
		if err != nil {
			return err
		}
		res.HandedOff = &next.id
	}
	return nil
}
