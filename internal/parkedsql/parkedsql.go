package parkedsql

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// The parked-keys table's name when retrytopic.ParkedKeysTable leaves it
// empty.
const (
	DefaultSchema = "public"
	DefaultTable  = "retry_parked_key"
)

// CheckName refuses a consumer group name before any statement runs: the
// deduplicator's ValidateGroupName (a name PostgreSQL cannot store is a
// typed error there). field names the argument in the error.
type CheckName func(field, name string) error

// table returns schema.table quoted, with the defaults for "" names, and
// checks group with check.
func table(schema, name, group string, check CheckName) (string, error) {
	if schema == "" {
		schema = DefaultSchema
	}
	if name == "" {
		name = DefaultTable
	}
	if err := ident.Validate("Schema", schema); err != nil {
		return "", fmt.Errorf("retrytopic: %w", err)
	}
	if err := ident.Validate("Table", name); err != nil {
		return "", fmt.Errorf("retrytopic: %w", err)
	}
	if err := check("consumerGroup", group); err != nil {
		return "", fmt.Errorf("retrytopic: %w", err)
	}
	return ident.Quote(schema, name), nil
}

// Key is one parked key: its first event, on the retry path, and the
// events waiting behind it.
type Key struct {
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

// Summary sums up the parked keys of one consumer group.
type Summary struct {
	ConsumerGroup string `json:"consumer_group"`
	// Keys is the number of parked keys, Events their events.
	Keys   int64 `json:"keys"`
	Events int64 `json:"events"`
	// MaxQueue is the longest queue of a key (its first event included).
	MaxQueue int64 `json:"max_queue"`
	// OldestAge is the time since the oldest parked event was parked.
	OldestAge time.Duration `json:"oldest_age"`
	// MaxHeadOverdue is the longest [Key.HeadOverdue].
	MaxHeadOverdue time.Duration `json:"max_head_overdue"`
}

// cte is the parked keys (k: queue length and oldest parked_at) and their
// heads (h), of group $1 ("" for every group).
func cte(table string) string {
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

// Keys returns the parked keys of group (of every group when "") in
// schema.table ("" for the defaults), the longest queues first, at most
// limit (0: all).
func Keys(ctx context.Context, db dbx.Querier, schema, name, group string, limit int, check CheckName) ([]Key, error) {
	t, err := table(schema, name, group, check)
	if err != nil {
		return nil, err
	}
	q := cte(t) + `SELECT k.consumer_group, k.partition_key, k.n, h.event_id, COALESCE(h.topic, ''), h.not_before,
	` + overdueSQL + `, extract(epoch FROM now() - k.oldest)::float8, h.attempt, h.error
FROM k JOIN h USING (consumer_group, partition_key)
ORDER BY k.n DESC, k.oldest, k.consumer_group, k.partition_key`
	args := []any{group}
	if limit > 0 {
		q += ` LIMIT $2`
		args = append(args, limit)
	}
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Key, error) {
		var p Key
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

// Summarize returns one [Summary] per consumer group with parked keys (of
// group only, unless ""), by group, in one query.
func Summarize(ctx context.Context, db dbx.Querier, schema, name, group string, check CheckName) ([]Summary, error) {
	t, err := table(schema, name, group, check)
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, cte(t)+`SELECT k.consumer_group, count(*), sum(k.n)::bigint, max(k.n),
	extract(epoch FROM now() - min(k.oldest))::float8, max(`+overdueSQL+`)
FROM k JOIN h USING (consumer_group, partition_key)
GROUP BY k.consumer_group ORDER BY k.consumer_group`, group)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: summarize parked keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Summary, error) {
		var s Summary
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
