package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// lockSQL reads name's position and its [Origin] FOR UPDATE, so that one holder of the
// name works on the table at a time, and sets synchronous_commit to off for
// the rest of the transaction (the position may commit asynchronously: a
// lost commit resends, it never skips).
const lockSQL = `SELECT ` + positionColumns + `, ` + originColumns + `, set_config('synchronous_commit', 'off', true)
		FROM %s WHERE consumer_group = $1 FOR UPDATE`

// Tx is a transaction on one connection, begun by [Tables.BeginLock]. It
// is a dbx.Querier; end it with Commit or Rollback.
type Tx struct {
	conn *pgx.Conn
	done bool
}

// Exec runs sql in the transaction.
func (tx *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return tx.conn.Exec(ctx, sql, args...)
}

// Query runs sql in the transaction.
func (tx *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return tx.conn.Query(ctx, sql, args...)
}

// QueryRow runs sql in the transaction.
func (tx *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return tx.conn.QueryRow(ctx, sql, args...)
}

// ErrCommitRolledBack is returned by [Tx.Commit] when the server rolled
// the transaction back instead (an earlier statement had failed): pgx's
// own error, so errors.Is(err, pgx.ErrTxCommitRollback) holds.
var ErrCommitRolledBack = pgx.ErrTxCommitRollback

// Commit commits the transaction. As pgx.Tx does, it closes the connection
// when it cannot tell that the transaction ended.
func (tx *Tx) Commit(ctx context.Context) error {
	tx.done = true
	tag, err := tx.conn.Exec(ctx, "COMMIT")
	if err != nil {
		if tx.conn.PgConn().TxStatus() != 'I' {
			_ = tx.conn.Close(ctx)
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return ErrCommitRolledBack
	}
	return nil
}

// Rollback rolls the transaction back unless it was committed; when that
// fails, it closes the connection (the pool then discards it).
func (tx *Tx) Rollback(ctx context.Context) {
	if tx.done {
		return
	}
	tx.done = true
	if _, err := tx.conn.Exec(ctx, "ROLLBACK"); err != nil {
		_ = tx.conn.Close(ctx)
	}
}

// BeginLock begins a transaction on conn and locks name's position in it
// (lockSQL; [ErrNoPosition] when name has no position, see
// [Tables.Register]), and checks that the position is from the running
// cluster ([*ForeignError] when not), in one round trip (BEGIN, the lock
// and the check are sent as one batch). On error the transaction is rolled
// back.
func (t Tables) BeginLock(ctx context.Context, conn *pgx.Conn, name string, limits Limits) (*Tx, Position, error) {
	tx := &Tx{conn: conn}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	if limits.Idle > 0 || limits.Lock > 0 {
		b.Queue(limitsSQL, ms(limits.Idle), ms(limits.Lock))
	}
	b.Queue(fmt.Sprintf(lockSQL, t.Offsets), name)
	// The running cluster's origin, in a statement of its own: its
	// snapshot is taken once the lock is held, so it sees the version of
	// the row the lock returned (which may have committed after the lock
	// statement's snapshot).
	b.Queue(`SELECT ` + originHere)
	br := conn.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil && (limits.Idle > 0 || limits.Lock > 0) {
		_, err = br.Exec()
	}
	var (
		p               Position
		stored, current originScan
	)
	if err == nil {
		var discard string
		p, err = scanPosition(br.QueryRow(), &stored.system, &stored.xmax, &discard)
	}
	if err == nil {
		err = br.QueryRow().Scan(&current.system, &current.xmax)
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err == nil {
		err = checkOrigin(name, stored, current)
	}
	if err != nil {
		tx.Rollback(context.WithoutCancel(ctx))
		if errors.Is(err, pgx.ErrNoRows) {
			err = ErrNoPosition
		}
		return nil, Position{}, err
	}
	return tx, p, nil
}

// Ack moves name's position, locked by [Tables.BeginLock] in this transaction,
// to p, and watermill-sql's columns to the (transaction_id, offset)
// position p has certainly passed. It returns [ErrNoPosition] when name has
// no position.
func (t Tables) Ack(ctx context.Context, db dbx.Querier, name string, p Position) error {
	sql, args := t.ackSQL(name, p)
	tag, err := db.Exec(ctx, sql, args...)
	if err == nil && tag.RowsAffected() == 0 {
		err = ErrNoPosition
	}
	return err
}

// ackSQL is the statement of [Tables.Ack] and its arguments.
func (t Tables) ackSQL(name string, p Position) (string, []any) {
	var cut *string
	var cutOffset *int64
	if p.Cut != nil {
		s := p.Cut.String()
		cut, cutOffset = &s, &p.CutOffset
	}
	wsqlTx, wsqlOff := watermillSQLColumns(p)
	return `UPDATE ` + t.Offsets + ` SET
			offset_acked = $2,
			last_processed_transaction_id = $3::text::xid8,
			position_snapshot = $4::text::pg_snapshot,
			cut_snapshot = $5::text::pg_snapshot,
			cut_offset = $6,
			(` + originSet + `) = (SELECT ` + originValues + `)
		WHERE consumer_group = $1`,
		[]any{name, wsqlOff, strconv.FormatUint(wsqlTx, 10), p.Snapshot.String(), cut, cutOffset}
}
