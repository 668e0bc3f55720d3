package sqltx

import (
	"context"
	"database/sql"
	"errors"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// errNoSavepoint: a Tx has no pseudo-nested transactions of pgx's.
var errNoSavepoint = errors.New("database/sql transaction: savepoints through pgx.Tx.Begin are not supported; run SAVEPOINT on the *sql.Tx")

// Tx is a database/sql transaction as a pgx.Tx: its statements run on the
// transaction's own connection, inside it; Commit and Rollback go through
// database/sql.
type Tx struct {
	conn *sql.Conn
	stx  *sql.Tx
	pc   *pgx.Conn

	once sync.Once
}

var _ pgx.Tx = (*Tx)(nil)

// SQL returns the *sql.Tx behind tx when tx is a [Tx].
func SQL(tx pgx.Tx) (*sql.Tx, bool) {
	t, ok := tx.(*Tx)
	if !ok || t == nil {
		return nil, false
	}
	return t.stx, true
}

// SQLTx returns the *sql.Tx.
func (t *Tx) SQLTx() *sql.Tx { return t.stx }

// Begin is not supported (see errNoSavepoint).
func (t *Tx) Begin(context.Context) (pgx.Tx, error) { return nil, errNoSavepoint }

// Commit commits through database/sql (pgx's COMMIT: a transaction that
// had failed reports pgx.ErrTxCommitRollback) and releases the connection.
// ctx is not used: database/sql ends a transaction with the context it
// began with.
func (t *Tx) Commit(context.Context) error {
	err := t.stx.Commit()
	t.release()
	return txErr(err)
}

// Rollback rolls back through database/sql and releases the connection.
func (t *Tx) Rollback(context.Context) error {
	err := t.stx.Rollback()
	t.release()
	return txErr(err)
}

func (t *Tx) release() {
	t.once.Do(func() { _ = t.conn.Close() })
}

// txErr maps database/sql's "already ended" to pgx's.
func txErr(err error) error {
	if errors.Is(err, sql.ErrTxDone) {
		return pgx.ErrTxClosed
	}
	return err
}

// CopyFrom runs COPY on the transaction's connection.
func (t *Tx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	return t.pc.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

// SendBatch sends b in the transaction.
func (t *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.pc.SendBatch(ctx, b)
}

// LargeObjects is not supported: it returns the zero value.
func (t *Tx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

// Prepare prepares on the transaction's connection.
func (t *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.pc.Prepare(ctx, name, sql)
}

// Exec runs sql in the transaction.
func (t *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.pc.Exec(ctx, sql, args...)
}

// Query runs sql in the transaction.
func (t *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.pc.Query(ctx, sql, args...)
}

// QueryRow runs sql in the transaction.
func (t *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.pc.QueryRow(ctx, sql, args...)
}

// Conn returns the transaction's *pgx.Conn.
func (t *Tx) Conn() *pgx.Conn { return t.pc }

// heldRows releases its connection once closed or read to the end.
type heldRows struct {
	pgx.Rows
	conn *sql.Conn
	once sync.Once
}

func (r *heldRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.release()
	return false
}

func (r *heldRows) Close() {
	r.Rows.Close()
	r.release()
}

func (r *heldRows) release() {
	r.once.Do(func() { _ = r.conn.Close() })
}

// row is pgx's QueryRow over heldRows.
type row struct {
	rows pgx.Rows
	err  error
}

func (r *row) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// heldBatch releases its connection once closed.
type heldBatch struct {
	pgx.BatchResults
	conn *sql.Conn
}

func (b *heldBatch) Close() error {
	err := b.BatchResults.Close()
	_ = b.conn.Close()
	return err
}
