package middleware

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/sqltx"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// SQLDB returns db, a *sql.DB opened with pgx's stdlib driver
// (sql.Open("pgx", url), stdlib.OpenDB, or gorm.io/driver/postgres's
// connection), as the library's database: pass it as [Config.DB] (every
// mode), to retrytopic's KeyOrder, the migrator, the outbox's
// PoolPublisher or idemtest. The middleware then begins each transaction
// through database/sql, so the handler gets a *sql.Tx
// ([SQLTxFromContext]) for GORM, bun, ent, sqlx or sqlc, and runs its own
// statements (claim, outbox rows, lease completion) on the same connection
// and in the same transaction. It costs one round trip more per
// transaction than a *pgxpool.Pool: database/sql sends BEGIN alone.
//
// The value implements migrate.Beginner, migrate.DBTX and
// deduplicator.BatchSender (pass it where they are asked for; idemtest's
// assertions take it too). A db of another driver (lib/pq) is refused
// with [ErrUnsupportedDriver].
func SQLDB(db *sql.DB) (*sqltx.DB, error) {
	d, err := sqltx.New(db)
	if err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	return d, nil
}

// SQLTxFromContext returns the message's transaction as a *sql.Tx when
// the middleware's DB is a *sql.DB ([SQLDB]). Run the handler's writes on
// it (gorm.DB.WithContext(ctx) over it, bun.Tx, sqlx.Tx, sqlc's
// Queries.WithTx): they commit together with the event's claim.
// [TxFromContext] returns the same transaction seen through pgx; use one
// or the other at a time, from the handler's goroutine.
func SQLTxFromContext(ctx context.Context) (*sql.Tx, bool) {
	v := idemctx.From(ctx)
	if v == nil || v.Tx == nil {
		return nil, false
	}
	return sqltx.SQL(v.Tx)
}

// MustSQLTxFromContext is [SQLTxFromContext] for handlers that cannot
// work without the transaction. It panics with [ErrNotInHandler] when ctx
// has none, with a hint when the middleware runs on pgx rather than
// database/sql, or in lease mode ([CompleteSQL]).
func MustSQLTxFromContext(ctx context.Context) *sql.Tx {
	if tx, ok := SQLTxFromContext(ctx); ok {
		return tx
	}
	if _, ok := TxFromContext(ctx); ok {
		panic(fmt.Errorf("%w: the middleware's Config.DB is not a *sql.DB (wrap it with idem.SQLDB); use idem.TxFromContext for its pgx.Tx", ErrNotInHandler))
	}
	if leaseStateFrom(ctx) != nil {
		panic(fmt.Errorf("%w: lease mode (Config.Mode: a *LeaseConfig) runs the handler without a transaction; register its writes with idem.CompleteSQL", ErrNotInHandler))
	}
	panic(ErrNotInHandler)
}

// CompleteSQL is [Complete] for handlers written on database/sql: fn gets
// the claiming transaction as a *sql.Tx. In lease mode it runs in the
// completing transaction; in transaction mode at once. fn's error is
// returned (transaction mode) or rolls the completion back (lease mode);
// when the middleware's DB is not a *sql.DB ([SQLDB]) fn does not run and
// the error wraps [ErrNotInHandler].
func CompleteSQL(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
		stx, ok := sqltx.SQL(tx)
		if !ok {
			return fmt.Errorf("%w: idem.CompleteSQL: the middleware's Config.DB is not a *sql.DB (wrap it with idem.SQLDB)", ErrNotInHandler)
		}
		return fn(ctx, stx)
	})
}

// concurrent reports whether db runs concurrent transactions and batches
// (lease mode's needs): a pool, or a *sql.DB.
func concurrent(db migrate.Beginner) bool {
	switch db.(type) {
	case dbx.Pool, *sqltx.DB:
		return true
	}
	return false
}

// maxConns is db's connection limit, 0 when it has none or is not a pool.
func maxConns(db migrate.Beginner) int {
	switch db := db.(type) {
	case dbx.Pool:
		return int(db.Stat().MaxConns())
	case *sqltx.DB:
		return db.MaxConns()
	}
	return 0
}
