package retrytopic

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
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

// ParkedKey is one parked key: its first event, on the retry path, and the
// events waiting behind it.
type ParkedKey struct {
	ConsumerGroup string `json:"consumer_group"`
	Key           string `json:"key"`
	// Events is the length of the key's queue: its first event and those
	// waiting behind it.
	Events int64 `json:"events"`
	// Head is the key's first event; HeadTopic and HeadNotBefore tell where
	// and until when its copy waits on the retry path.
	Head          uuid.UUID `json:"head"`
	HeadTopic     string    `json:"head_topic"`
	HeadNotBefore time.Time `json:"head_not_before"`
	// HeadOverdue is how long the head's copy has been due (0 while it is
	// not): a copy long overdue is not coming back (its retry topic's
	// retention ran out, or no retry consumer runs).
	HeadOverdue time.Duration `json:"head_overdue"`
	// OldestAge is the time since the key's oldest event was parked.
	OldestAge time.Duration `json:"oldest_age"`
	// HeadAttempt and HeadError are the head's last retry attempt and the
	// error that sent it to the retry path (its stored metadata
	// retry_attempt and retry_error; 0 and "" when it has none). Both come
	// from the message: show them as text.
	HeadAttempt int    `json:"head_attempt"`
	HeadError   string `json:"head_error"`
}

// ParkedSummary sums up the parked keys of one consumer group.
type ParkedSummary struct {
	ConsumerGroup string `json:"consumer_group"`
	// Keys is the number of parked keys, Events their events.
	Keys   int64 `json:"keys"`
	Events int64 `json:"events"`
	// MaxQueue is the longest queue of a key (its first event included).
	MaxQueue int64 `json:"max_queue"`
	// OldestAge is the time since the oldest parked event was parked.
	OldestAge time.Duration `json:"oldest_age"`
	// MaxHeadOverdue is the longest [ParkedKey.HeadOverdue].
	MaxHeadOverdue time.Duration `json:"max_head_overdue"`
}

// parkedCTE is the parked keys (k: queue length and oldest parked_at)
// and their heads (h), of group $1 ("" for every group).
func parkedCTE(table string) string {
	return `WITH k AS (
	SELECT consumer_group, partition_key, count(*) AS n, min(parked_at) AS oldest
	FROM ` + table + ` WHERE $1 = '' OR consumer_group = $1 GROUP BY consumer_group, partition_key
), h AS (
	SELECT DISTINCT ON (consumer_group, partition_key) consumer_group, partition_key, event_id, topic, not_before,
		COALESCE(metadata->>'retry_attempt', '') AS attempt, COALESCE(metadata->>'retry_error', '') AS error
	FROM ` + table + ` WHERE $1 = '' OR consumer_group = $1 ORDER BY consumer_group, partition_key, seq
)
`
}

// overdueSQL is the seconds since h's copy has been due, 0 while it is not.
const overdueSQL = `COALESCE(GREATEST(extract(epoch FROM now() - h.not_before), 0), 0)::float8`

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ParkedKeys returns the parked keys of consumerGroup (of every group when
// ""), the longest queues first, at most limit (0: all).
func ParkedKeys(ctx context.Context, db migrate.DBTX, t ParkedKeysTable, consumerGroup string, limit int) ([]ParkedKey, error) {
	if err := checkParkedArgs(&t, consumerGroup); err != nil {
		return nil, err
	}
	q := parkedCTE(ident.Quote(t.Schema, t.Table)) + `SELECT k.consumer_group, k.partition_key, k.n, h.event_id, COALESCE(h.topic, ''), h.not_before,
	` + overdueSQL + `, extract(epoch FROM now() - k.oldest)::float8, h.attempt, h.error
FROM k JOIN h USING (consumer_group, partition_key)
ORDER BY k.n DESC, k.oldest, k.consumer_group, k.partition_key`
	args := []any{consumerGroup}
	if limit > 0 {
		q += ` LIMIT $2`
		args = append(args, limit)
	}
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedKey, error) {
		var p ParkedKey
		var nb *time.Time
		var overdue, age float64
		var attempt string
		err := row.Scan(&p.ConsumerGroup, &p.Key, &p.Events, &p.Head, &p.HeadTopic, &nb, &overdue, &age, &attempt, &p.HeadError)
		if nb != nil {
			p.HeadNotBefore = *nb
		}
		p.HeadAttempt, _ = strconv.Atoi(attempt) // a malformed header counts as none
		p.HeadOverdue, p.OldestAge = seconds(overdue), seconds(age)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("retrytopic: parked keys: %w", err)
	}
	return out, nil
}

// SummarizeParked returns one [ParkedSummary] per consumer group with
// parked keys (of consumerGroup only, unless ""), by group, in one query.
// The exporters report it as gauges.
func SummarizeParked(ctx context.Context, db migrate.DBTX, t ParkedKeysTable, consumerGroup string) ([]ParkedSummary, error) {
	if err := checkParkedArgs(&t, consumerGroup); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, parkedCTE(ident.Quote(t.Schema, t.Table))+`SELECT k.consumer_group, count(*), sum(k.n)::bigint, max(k.n),
	extract(epoch FROM now() - min(k.oldest))::float8, max(`+overdueSQL+`)
FROM k JOIN h USING (consumer_group, partition_key)
GROUP BY k.consumer_group ORDER BY k.consumer_group`, consumerGroup)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: summarize parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedSummary, error) {
		var s ParkedSummary
		var age, overdue float64
		err := row.Scan(&s.ConsumerGroup, &s.Keys, &s.Events, &s.MaxQueue, &age, &overdue)
		s.OldestAge, s.MaxHeadOverdue = seconds(age), seconds(overdue)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("retrytopic: summarize parked keys: %w", err)
	}
	return out, nil
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
