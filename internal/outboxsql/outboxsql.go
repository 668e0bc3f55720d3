// Package outboxsql holds every statement the module runs on the outbox
// tables besides watermill-sql's own (its INSERT of messages and its CREATE
// TABLEs): the forwarder's registration, position lock, batch read and
// position update, the backlog, the deletion of forwarded rows and the read
// of a topic's messages for idemtest. It is the one place that knows the
// columns of watermill-sql v4's PostgreSQL layout:
//
//	messages: "offset" BIGSERIAL, uuid, created_at, payload, metadata (JSON),
//	          transaction_id xid8 (the writer's pg_current_xact_id()),
//	          PRIMARY KEY (transaction_id, "offset")
//	offsets:  consumer_group PRIMARY KEY, offset_acked BIGINT,
//	          last_processed_transaction_id xid8
//
// A row of the offsets table is a [Position], keyed by consumer_group: a
// watermill-sql subscriber's consumer group, or an outbox forwarder's name.
//
// Every statement works in all of pgx's query exec modes (the simple
// protocol included): transaction ids travel as uint64 with an explicit
// ::xid8 cast.
package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB runs statements: a pgx.Tx, a *pgx.Conn or a *pgxpool.Pool.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Tables are one topic's messages and offsets tables, quoted and
// schema-qualified.
type Tables struct {
	Messages, Offsets string
}

// Position is a place in a topic's messages table, in the order rows are
// forwarded: (transaction_id, "offset") of the last row passed. The zero
// Position is before every row (watermill-sql registers consumer groups
// there).
type Position struct {
	// TxID is the transaction_id (xid8) of the last row passed.
	TxID uint64
	// Offset is its "offset".
	Offset int64
}

// Row is a row of a messages table.
type Row struct {
	// Position is the row's own place: its transaction_id and "offset".
	Position Position
	UUID     string
	Payload  []byte
	// Metadata is a JSON object, or nil.
	Metadata []byte
}

// Message returns the row as a Watermill message, its metadata decoded.
func (r Row) Message() (*message.Message, error) {
	msg := message.NewMessage(r.UUID, r.Payload)
	if r.Metadata != nil {
		md, err := decodeMetadata(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("outbox row (%d, %d) metadata: %w", r.Position.TxID, r.Position.Offset, err)
		}
		msg.Metadata = md
	}
	return msg, nil
}

// Register inserts name's position at the start of the table unless it has
// one, so that [Tables.Lock] has a row to lock (watermill-sql's
// before-subscribing query).
func (t Tables) Register(ctx context.Context, db DB, name string) error {
	_, err := db.Exec(ctx, `INSERT INTO `+t.Offsets+` (consumer_group, offset_acked, last_processed_transaction_id)
		VALUES ($1, 0, '0') ON CONFLICT (consumer_group) DO NOTHING`, name)
	return err
}

// Lock reads name's position FOR UPDATE, so that one holder of the name
// works on the table at a time. It returns pgx.ErrNoRows when name has no
// position ([Tables.Register]).
func (t Tables) Lock(ctx context.Context, db DB, name string) (Position, error) {
	var p Position
	err := db.QueryRow(ctx, `SELECT last_processed_transaction_id, COALESCE(offset_acked, 0) FROM `+t.Offsets+`
		WHERE consumer_group = $1 FOR UPDATE`, name).Scan(&p.TxID, &p.Offset)
	return p, err
}

// Ack moves name's position to p (watermill-sql's upsert).
func (t Tables) Ack(ctx context.Context, db DB, name string, p Position) error {
	_, err := db.Exec(ctx, `INSERT INTO `+t.Offsets+` (consumer_group, offset_acked, last_processed_transaction_id)
		VALUES ($1, $2, $3::xid8)
		ON CONFLICT (consumer_group) DO UPDATE SET
			offset_acked = excluded.offset_acked,
			last_processed_transaction_id = excluded.last_processed_transaction_id`, name, p.Offset, p.TxID)
	return err
}

// ReadBatchSQL selects, from messages, the rows after the position ($1, $2)
// written by transactions older than the snapshot's xmin, in
// (transaction_id, offset) order, at most $3 of them: watermill-sql's
// visibility rule, so a transaction still running holds the reader back
// instead of being skipped. Unlike watermill-sql's query, whose OR form is
// planned as a bitmap scan of every pending row plus a top-N sort (30 ms per
// batch with 100,000 rows pending, measured), the row comparison walks the
// primary key in order and stops after LIMIT rows, so a backlog does not
// slow every batch down.
func ReadBatchSQL(messages string) string {
	return `SELECT transaction_id, "offset", uuid, payload, metadata FROM ` + messages + `
		WHERE (transaction_id, "offset") > ($1::xid8, $2)
		  AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY transaction_id, "offset"
		LIMIT $3`
}

// ReadBatch appends to dst the rows after p ([ReadBatchSQL]), at most limit.
// Run it in a REPEATABLE READ transaction to read several batches below one
// xmin.
func (t Tables) ReadBatch(ctx context.Context, db DB, after Position, limit int, dst []Row) ([]Row, error) {
	rows, err := db.Query(ctx, ReadBatchSQL(t.Messages), after.TxID, after.Offset, limit)
	if err != nil {
		return dst, err
	}
	return appendRows(rows, dst)
}

// ReadAll returns every row db sees in the messages table (a transaction's
// own uncommitted rows included, the xmin rule not applied), in
// (transaction_id, offset) order.
func (t Tables) ReadAll(ctx context.Context, db DB) ([]Row, error) {
	rows, err := db.Query(ctx, `SELECT transaction_id, "offset", uuid, payload, metadata FROM `+t.Messages+`
		ORDER BY transaction_id, "offset"`)
	if err != nil {
		return nil, err
	}
	return appendRows(rows, nil)
}

func appendRows(rows pgx.Rows, dst []Row) ([]Row, error) {
	defer rows.Close()
	for rows.Next() {
		var r Row
		if err := rows.Scan(&r.Position.TxID, &r.Position.Offset, &r.UUID, &r.Payload, &r.Metadata); err != nil {
			return dst, err
		}
		dst = append(dst, r)
	}
	return dst, rows.Err()
}

// Backlog counts the committed rows after name's position (every row when
// name has no position) and returns how long the oldest of them has been
// waiting, by its created_at (0 when none).
func (t Tables) Backlog(ctx context.Context, db DB, name string) (pending int64, oldest time.Duration, err error) {
	var ageSec float64
	err = db.QueryRow(ctx, `
		WITH pos AS (
			SELECT last_processed_transaction_id AS tx, COALESCE(offset_acked, 0) AS off
			FROM `+t.Offsets+` WHERE consumer_group = $1)
		SELECT count(*), COALESCE(EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(m.created_at)), 0)::float8
		FROM `+t.Messages+` m
		WHERE NOT EXISTS (SELECT 1 FROM pos)
		   OR (m.transaction_id, m."offset") > (SELECT tx, off FROM pos)`, name).Scan(&pending, &ageSec)
	if err != nil {
		return 0, 0, err
	}
	if ageSec > 0 {
		oldest = time.Duration(ageSec * float64(time.Second))
	}
	return pending, oldest, nil
}

// ErrNoPosition is returned by [Tables.Lowest] when one of the names has
// no position.
var ErrNoPosition = errors.New("no position")

// Lowest returns the lowest of the positions of names (every row at or
// before it has been passed by all of them), or [ErrNoPosition] if one of
// them has none.
func (t Tables) Lowest(ctx context.Context, db DB, names []string) (Position, error) {
	names = slices.Compact(slices.Sorted(slices.Values(names)))
	var (
		p     Position
		found int
	)
	err := db.QueryRow(ctx, `SELECT last_processed_transaction_id, COALESCE(offset_acked, 0), count(*) OVER ()
		FROM `+t.Offsets+` WHERE consumer_group = ANY($1)
		ORDER BY last_processed_transaction_id, COALESCE(offset_acked, 0) LIMIT 1`, names).Scan(&p.TxID, &p.Offset, &found)
	if errors.Is(err, pgx.ErrNoRows) || err == nil && found < len(names) {
		return Position{}, ErrNoPosition
	}
	return p, err
}

// DeleteThrough deletes at most limit rows at or before p and returns how
// many it deleted.
func (t Tables) DeleteThrough(ctx context.Context, db DB, p Position, limit int) (int64, error) {
	tag, err := db.Exec(ctx, `DELETE FROM `+t.Messages+` WHERE ctid IN (
		SELECT ctid FROM `+t.Messages+` WHERE (transaction_id, "offset") <= ($1::xid8, $2) LIMIT $3)`, p.TxID, p.Offset, limit)
	return tag.RowsAffected(), err
}
