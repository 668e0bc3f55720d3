package auditsql

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations are the audit tables' versioned templates (NNN_name.up.sql and
// .down.sql at the root), rendered with struct{ Schema string }: the caller
// builds the migrate.Line, recorded under [Component].
var Migrations = func() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	return sub
}()

// Component keys the audit tables' versions in idem_schema_migration.
const Component = "idem_audit"

// Actions and results.
const (
	ActionReplay     = "replay"
	ActionDiscard    = "discard"
	ActionEditReplay = "edit_replay"

	ResultOK      = "ok"
	ResultRefused = "refused"
	ResultFailed  = "failed"
)

// ErrAppendOnly is what the tables' triggers answer to an UPDATE, DELETE or
// TRUNCATE (SQLSTATE 23001).
var ErrAppendOnly = errors.New("auditsql: the audit trail is append-only")

// Message is one poison record an action touched.
type Message struct {
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
	EventID   string `json:"event_id"`
	// Original is the payload before an edit (edit_replay only).
	Original []byte `json:"original,omitempty"`
}

// Entry is one action.
type Entry struct {
	ID int64 `json:"id"`
	// At is the database's clock at Append.
	At time.Time `json:"at"`
	// Actor is the name given with the console's token.
	Actor  string `json:"actor"`
	Action string `json:"action"`
	// Topic is the poison topic the messages were read from.
	Topic string `json:"topic"`
	// Filter is the explorer's filter of a batch action, nil for one
	// message.
	Filter json.RawMessage `json:"filter,omitempty"`
	Result string          `json:"result"`
	// Detail says why an action was refused or failed, or what it did.
	Detail   string    `json:"detail"`
	Messages []Message `json:"messages"`
	// MessageCount is the number of messages (List returns at most a few of
	// them in Messages).
	MessageCount int `json:"message_count"`
}

func tables(schema string) (audit, msgs string, err error) {
	if err := ident.Validate("schema", schema); err != nil {
		return "", "", fmt.Errorf("auditsql: %w", err)
	}
	return ident.Quote(schema, "idem_audit"), ident.Quote(schema, "idem_audit_message"), nil
}

// Append writes e and its messages in one transaction and returns its id
// and time.
func Append(ctx context.Context, db dbx.Beginner, schema string, e Entry) (int64, time.Time, error) {
	audit, msgs, err := tables(schema)
	if err != nil {
		return 0, time.Time{}, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("auditsql: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var filter any
	if len(e.Filter) > 0 {
		filter = string(e.Filter)
	}
	var id int64
	var at time.Time
	err = tx.QueryRow(ctx, `INSERT INTO `+audit+` (actor, action, topic, filter, result, detail)
VALUES ($1, $2, $3, $4::jsonb, $5, $6) RETURNING id, at`, e.Actor, e.Action, e.Topic, filter, e.Result, e.Detail).Scan(&id, &at)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("auditsql: append: %w", err)
	}
	if len(e.Messages) > 0 {
		rows := make([][]any, len(e.Messages))
		for i, m := range e.Messages {
			rows[i] = []any{id, e.Topic, m.Partition, m.Offset, m.EventID, m.Original}
		}
		_, err = tx.CopyFrom(ctx, pgx.Identifier{schema, "idem_audit_message"},
			[]string{"audit_id", "topic", "kafka_partition", "kafka_offset", "event_id", "original_payload"}, pgx.CopyFromRows(rows))
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("auditsql: append messages to %s: %w", msgs, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, time.Time{}, fmt.Errorf("auditsql: commit: %w", err)
	}
	return id, at, nil
}

// Refused reports whether err is a trigger's refusal of a change to the
// trail, and returns it as [ErrAppendOnly].
func Refused(err error) error {
	if pgerr.Has(err, pgerrcode.RestrictViolation) {
		return fmt.Errorf("%w: %w", ErrAppendOnly, err)
	}
	return err
}

// listMessages is how many messages of each entry List returns.
const listMessages = 5

// List returns at most limit entries with an id below before (0: the
// newest), newest first, each with its first few messages (without their
// original payloads) and its message count.
func List(ctx context.Context, db dbx.Querier, schema string, before int64, limit int) ([]Entry, error) {
	audit, msgs, err := tables(schema)
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, `SELECT a.id, a.at, a.actor, a.action, a.topic, a.filter, a.result, a.detail,
  (SELECT count(*) FROM `+msgs+` m WHERE m.audit_id = a.id),
  coalesce((SELECT jsonb_agg(jsonb_build_object('partition', m.kafka_partition, 'offset', m.kafka_offset, 'event_id', m.event_id)
            ORDER BY m.kafka_partition, m.kafka_offset)
     FROM (SELECT * FROM `+msgs+` m WHERE m.audit_id = a.id ORDER BY kafka_partition, kafka_offset LIMIT $3) m), '[]')
FROM `+audit+` a
WHERE $1 = 0 OR a.id < $1
ORDER BY a.id DESC LIMIT $2`, before, limit, listMessages)
	if err != nil {
		return nil, fmt.Errorf("auditsql: list: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Entry, error) {
		var e Entry
		var filter, ms []byte
		err := r.Scan(&e.ID, &e.At, &e.Actor, &e.Action, &e.Topic, &filter, &e.Result, &e.Detail, &e.MessageCount, &ms)
		if err != nil {
			return e, err
		}
		if filter != nil {
			e.Filter = filter
		}
		return e, json.Unmarshal(ms, &e.Messages)
	})
	if err != nil {
		return nil, fmt.Errorf("auditsql: list: %w", err)
	}
	return out, nil
}

// Location is a record of a poison topic.
type Location struct {
	Partition int32
	Offset    int64
}

// Disposition is the last action done on a record: an action that failed
// part way lists the records it did, a refused one did nothing.
type Disposition struct {
	AuditID int64     `json:"audit_id"`
	Action  string    `json:"action"`
	Actor   string    `json:"actor"`
	At      time.Time `json:"at"`
}

// Dispositions returns, for each of locs of topic that an action did (not
// refused), the latest such action: one query whatever the number of
// locations.
func Dispositions(ctx context.Context, db dbx.Querier, schema, topic string, locs []Location) (map[Location]Disposition, error) {
	audit, msgs, err := tables(schema)
	if err != nil {
		return nil, err
	}
	parts := make([]int32, len(locs))
	offs := make([]int64, len(locs))
	for i, l := range locs {
		parts[i], offs[i] = l.Partition, l.Offset
	}
	rows, err := db.Query(ctx, `SELECT DISTINCT ON (m.kafka_partition, m.kafka_offset) m.kafka_partition, m.kafka_offset, a.id, a.action, a.actor, a.at
FROM unnest($2::int[], $3::bigint[]) AS l(p, o)
JOIN `+msgs+` m ON m.topic = $1 AND m.kafka_partition = l.p AND m.kafka_offset = l.o
JOIN `+audit+` a ON a.id = m.audit_id AND a.result <> 'refused'
ORDER BY m.kafka_partition, m.kafka_offset, a.id DESC`, topic, parts, offs)
	if err != nil {
		return nil, fmt.Errorf("auditsql: dispositions: %w", err)
	}
	out := map[Location]Disposition{}
	var l Location
	var d Disposition
	_, err = pgx.ForEachRow(rows, []any{&l.Partition, &l.Offset, &d.AuditID, &d.Action, &d.Actor, &d.At}, func() error {
		out[l] = d
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("auditsql: dispositions: %w", err)
	}
	return out, nil
}
