package sqltx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// ErrUnsupportedDriver is middleware.ErrUnsupportedDriver: the *sql.DB was
// not opened with pgx's stdlib driver.
var ErrUnsupportedDriver = errors.New("watermill-idempotency: unsupported database/sql driver: open the *sql.DB with pgx's driver (github.com/jackc/pgx/v5/stdlib: sql.Open(\"pgx\", url), stdlib.OpenDB or stdlib.OpenDBFromPool; gorm.io/driver/postgres uses it)")

// DB is a *sql.DB seen as the library's database: it begins transactions
// through database/sql (see [SQL]) and runs single statements and batches
// on a connection of the pool, as a *pgxpool.Pool would.
type DB struct {
	db *sql.DB
}

// New returns db as a DB, or an error wrapping [ErrUnsupportedDriver] when
// db's driver is not pgx's.
func New(db *sql.DB) (*DB, error) {
	if db == nil {
		return nil, errors.New("nil *sql.DB")
	}
	if _, ok := db.Driver().(*stdlib.Driver); !ok {
		return nil, fmt.Errorf("%w (the driver is a %T)", ErrUnsupportedDriver, db.Driver())
	}
	return &DB{db: db}, nil
}

// SQLDB returns the wrapped *sql.DB.
func (d *DB) SQLDB() *sql.DB { return d.db }

// MaxConns is db's SetMaxOpenConns, 0 when unlimited.
func (d *DB) MaxConns() int { return d.db.Stats().MaxOpenConnections }

// Begin begins a transaction with the server's defaults.
func (d *DB) Begin(ctx context.Context) (pgx.Tx, error) {
	return d.BeginTx(ctx, pgx.TxOptions{})
}

// BeginTx begins a transaction through database/sql on a connection of its
// own and returns it as a pgx.Tx whose statements run on that connection's
// *pgx.Conn; [SQL] returns its *sql.Tx. Commit and Rollback end the
// transaction through database/sql and give the connection back to the
// pool. The transaction is not rolled back by database/sql when ctx ends
// (the owner ends it), so the library's statements and the handler's never
// run beside an asynchronous rollback.
func (d *DB) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	sopts, err := sqlOptions(opts)
	if err != nil {
		return nil, err
	}
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	pc, err := pgxConn(conn)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	stx, err := conn.BeginTx(context.WithoutCancel(ctx), sopts)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &Tx{conn: conn, stx: stx, pc: pc}, nil
}

// Exec runs sql on a connection of the pool.
func (d *DB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	conn, pc, err := d.acquire(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer conn.Close()
	return pc.Exec(ctx, sql, args...)
}

// Query runs sql on a connection of the pool, held until the rows are
// closed or read to their end.
func (d *DB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	conn, pc, err := d.acquire(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := pc.Query(ctx, sql, args...)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &heldRows{Rows: rows, conn: conn}, nil
}

// QueryRow is Query for one row: pgx's rules (pgx.ErrNoRows).
func (d *DB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := d.Query(ctx, sql, args...)
	return &row{rows: rows, err: err}
}

// SendBatch sends b on a connection of the pool, held until the results
// are closed.
func (d *DB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	conn, pc, err := d.acquire(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return &heldBatch{BatchResults: pc.SendBatch(ctx, b), conn: conn}
}

// acquire takes a connection of the pool for the caller alone: database/sql
// hands it to nobody else until it is closed.
func (d *DB) acquire(ctx context.Context) (*sql.Conn, *pgx.Conn, error) {
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return nil, nil, err
	}
	pc, err := pgxConn(conn)
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	return conn, pc, nil
}

// pgxConn returns conn's *pgx.Conn. The session stays conn's: database/sql
// hands the connection to no one else while conn is open, so statements
// on it need no lock of database/sql's.
func pgxConn(conn *sql.Conn) (*pgx.Conn, error) {
	var pc *pgx.Conn
	err := conn.Raw(func(dc any) error {
		sc, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("%w (the connection is a %T)", ErrUnsupportedDriver, dc)
		}
		pc = sc.Conn()
		return nil
	})
	return pc, err
}

// sqlOptions translates opts; what database/sql cannot say is refused.
func sqlOptions(opts pgx.TxOptions) (*sql.TxOptions, error) {
	var o sql.TxOptions
	switch opts.IsoLevel {
	case "":
	case pgx.Serializable:
		o.Isolation = sql.LevelSerializable
	case pgx.RepeatableRead:
		o.Isolation = sql.LevelRepeatableRead
	case pgx.ReadCommitted:
		o.Isolation = sql.LevelReadCommitted
	case pgx.ReadUncommitted:
		o.Isolation = sql.LevelReadUncommitted
	default:
		return nil, fmt.Errorf("database/sql: isolation level %q not supported", opts.IsoLevel)
	}
	switch opts.AccessMode {
	case "", pgx.ReadWrite:
	case pgx.ReadOnly:
		o.ReadOnly = true
	default:
		return nil, fmt.Errorf("database/sql: access mode %q not supported", opts.AccessMode)
	}
	if opts.DeferrableMode != "" || opts.BeginQuery != "" || opts.CommitQuery != "" {
		return nil, errors.New("database/sql: TxOptions.DeferrableMode, BeginQuery and CommitQuery are not supported (database/sql cannot express them)")
	}
	return &o, nil
}
