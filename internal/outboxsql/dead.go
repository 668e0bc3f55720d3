package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// DeadRow is a row of the dead table: a row the forwarder could not send,
// or a later row of its partition key, moved there with its cause.
type DeadRow struct {
	// ID orders the dead rows; a key's rows are retried in it.
	ID int64
	// Row is the row as it stood in the messages table.
	Row
	CreatedAt time.Time
	// Key is the row's partition_key metadata, "" when none.
	Key string
	// Cause says why it was not sent.
	Cause string
	// HeldBehind is the ID of the dead row it waits behind, 0 for a row
	// that is poison itself.
	HeldBehind int64
	// Size is the size of the Kafka record it makes, 0 when none was built.
	Size          int
	QuarantinedAt time.Time
}

// Quarantine moves the row (txID, offset) from the messages table to the
// dead table with its key, cause, the dead row it waits behind (0: none)
// and its record size, and returns its dead id. It reports 0 when the row
// is no longer there (deleted meanwhile).
func (t Tables) Quarantine(ctx context.Context, db dbx.Querier, r Row, key, cause string, heldBehind int64, size int) (int64, error) {
	var held *int64
	if heldBehind > 0 {
		held = &heldBehind
	}
	var id int64
	err := db.QueryRow(ctx, `WITH moved AS (
			DELETE FROM `+t.Messages+` WHERE transaction_id = $1::text::xid8 AND "offset" = $2
			RETURNING "offset", transaction_id, uuid, created_at, payload, metadata)
		INSERT INTO `+t.Dead+` ("offset", transaction_id, uuid, created_at, payload, metadata, partition_key, cause, held_behind, size)
		SELECT "offset", transaction_id, uuid, created_at, payload, metadata, $3, $4, $5, $6 FROM moved
		RETURNING id`, fmt.Sprint(r.TxID), r.Offset, key, cause, held, size).Scan(&id)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, nil
		}
		return 0, err
	}
	return id, nil
}

// DeadKeys returns the partition keys that have dead rows, each with the
// id of its first one: the forwarder holds the later rows of those keys.
// Rows without a key hold nothing back.
func (t Tables) DeadKeys(ctx context.Context, db dbx.Querier) (map[string]int64, error) {
	rows, err := db.Query(ctx, deadKeysSQL(t.Dead))
	if err != nil {
		return nil, err
	}
	return scanDeadKeys(rows)
}

// deadKeysSQL reads each key of dead with its first row's id.
func deadKeysSQL(dead string) string {
	return `SELECT partition_key, min(id) FROM ` + dead + ` WHERE partition_key <> '' GROUP BY partition_key`
}

func scanDeadKeys(rows pgx.Rows) (map[string]int64, error) {
	defer rows.Close()
	keys := map[string]int64{}
	for rows.Next() {
		var k string
		var id int64
		if err := rows.Scan(&k, &id); err != nil {
			return nil, err
		}
		keys[k] = id
	}
	return keys, rows.Err()
}

// DeadRows lists the dead rows in id order, at most limit (≤ 0: all), with
// a key of key when key is not nil.
func (t Tables) DeadRows(ctx context.Context, db dbx.Querier, key *string, limit int) ([]DeadRow, error) {
	q := `SELECT id, transaction_id, "offset", uuid, payload, metadata, created_at, partition_key, cause,
		coalesce(held_behind, 0), size, quarantined_at FROM ` + t.Dead + ` WHERE ($1::text IS NULL OR partition_key = $1) ORDER BY id`
	args := []any{key}
	if limit > 0 {
		q += ` LIMIT $2`
		args = append(args, limit)
	}
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []DeadRow
	for rows.Next() {
		var d DeadRow
		if err := rows.Scan(&d.ID, &d.TxID, &d.Offset, &d.UUID, &d.Payload, &d.Metadata, &d.CreatedAt, &d.Key, &d.Cause,
			&d.HeldBehind, &d.Size, &d.QuarantinedAt); err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// RetryDead moves the dead rows of key back into the messages table, in
// their order, as rows written by the calling transaction (new offsets,
// the same uuid, payload and metadata), and returns how many. The
// forwarder sends them as any new rows; one that still cannot be sent comes
// back, with the rest of the key behind it.
func (t Tables) RetryDead(ctx context.Context, db dbx.Querier, key string) (int64, error) {
	// Writers wait until the retry commits, and the retry waits for those
	// in flight: no row of the key can commit between the check below and
	// the moved rows (it would go out before them, or be held behind the
	// key's dead rows after they left). Writes only pause for the retry's
	// few statements. A forwarder's quarantine (a DELETE) waits too.
	if _, err := db.Exec(ctx, `LOCK TABLE `+t.Messages+` IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		return 0, err
	}
	if err := t.checkKeyForwarded(ctx, db, key); err != nil {
		return 0, err
	}
	rows, err := db.Query(ctx, `SELECT id FROM `+t.Dead+` WHERE partition_key = $1 ORDER BY id FOR UPDATE`, key)
	if err != nil {
		return 0, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, err
	}
	// One INSERT per row, in id order: each takes the next "offset", so
	// the key's order is kept whatever order a set INSERT would use.
	for _, id := range ids {
		if _, err := db.Exec(ctx, `INSERT INTO `+t.Messages+` (uuid, created_at, payload, metadata, transaction_id)
			SELECT uuid, created_at, payload, metadata, pg_current_xact_id() FROM `+t.Dead+` WHERE id = $1`, id); err != nil {
			return 0, err
		}
	}
	if _, err := db.Exec(ctx, `DELETE FROM `+t.Dead+` WHERE id = ANY ($1)`, ids); err != nil {
		return 0, err
	}
	return int64(len(ids)), nil
}

// RetryDeadTx runs [Tables.RetryDead] in a transaction of its own on db.
func (t Tables) RetryDeadTx(ctx context.Context, db dbx.Beginner, key string) (n int64, err error) {
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		n, err = t.RetryDead(ctx, tx, key)
		return err
	})
	return n, err
}

// DeadCount counts the dead rows.
func (t Tables) DeadCount(ctx context.Context, db dbx.Querier) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, `SELECT count(*) FROM `+t.Dead).Scan(&n)
	return n, err
}

// DropDead deletes the dead row id and reports whether it was there. The
// rows held behind it stay: retry their key to send them.
func (t Tables) DropDead(ctx context.Context, db dbx.Querier, id int64) (bool, error) {
	tag, err := db.Exec(ctx, `DELETE FROM `+t.Dead+` WHERE id = $1`, id)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// KeyPendingError is returned by [Tables.RetryDead] when rows of the key
// are still in the messages table, not yet read by a forwarder: moved
// back now, the dead rows would be sent after them, out of the key's
// order. Once the forwarder has read them (they join the dead table,
// held behind the key's dead row), the retry moves them all, in order.
type KeyPendingError struct {
	Key, Forwarder string
	Rows           int64
}

// ErrKeyPending is inside every *KeyPendingError.
var ErrKeyPending = errors.New("outbox: rows of the key are not yet forwarded")

func (e *KeyPendingError) Unwrap() error { return ErrKeyPending }

func (e *KeyPendingError) Error() string {
	return fmt.Sprintf("key %q has %d rows not yet forwarded by %s, which would be sent before its dead rows: "+
		"retry once the forwarder has read them (they join the dead table behind the key's dead row)", e.Key, e.Rows, e.Forwarder)
}

// checkKeyForwarded returns a *KeyPendingError when a forwarder of the
// topic (any name with a snapshot position: watermill-sql subscribers'
// rows have none) has not yet passed a row of key. The key "" holds
// nothing back (rows without a key are never held), so it is not checked.
func (t Tables) checkKeyForwarded(ctx context.Context, db dbx.Querier, key string) error {
	if key == "" {
		return nil
	}
	rows, err := db.Query(ctx, `SELECT consumer_group FROM `+t.Offsets+` WHERE position_snapshot IS NOT NULL ORDER BY consumer_group`)
	if err != nil {
		return err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, name := range names {
		p, err := t.Position(ctx, db, name)
		if err != nil {
			return fmt.Errorf("position of %s: %w", name, err)
		}
		var cut *string
		if p.Cut != nil {
			s := p.Cut.String()
			cut = &s
		}
		var n int64
		if err := db.QueryRow(ctx, `SELECT count(*) FROM `+t.Messages+` m WHERE `+pendingWhere+`
			AND COALESCE(m.metadata->>'partition_key', '') = $4`, p.Snapshot.String(), cut, p.CutOffset, key).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return &KeyPendingError{Key: key, Forwarder: name, Rows: n}
		}
	}
	return nil
}
