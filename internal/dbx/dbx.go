// Package dbx names the database interfaces the library accepts, each the
// smallest a caller needs (pgx's advice): a *pgxpool.Pool, a *pgx.Conn and
// a pgx.Tx fit Querier and Beginner; a pool and a conn fit BatchSender
// and TxBeginner. The public names are migrate.DBTX, migrate.Beginner and
// deduplicator.BatchSender, aliases of these.
package dbx

import (
	"fmt"

	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Querier runs statements.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner begins a transaction (a savepoint on a pgx.Tx).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// TxBeginner begins a transaction with options.
type TxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// BatchSender runs a pgx.Batch in one round trip. Outside a transaction
// its statements run in one implicit transaction (one Sync): they commit
// together or not at all.
type BatchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Concurrent runs concurrent transactions on connections of its own, and
// batches: a *pgxpool.Pool, or a *sql.DB through internal/sqltx.
type Concurrent interface {
	Querier
	Beginner
	BatchSender
}

// Pool runs concurrent transactions on connections of its own, and
// batches: a *pgxpool.Pool.
type Pool interface {
	Querier
	Beginner
	BatchSender
	Stat() *pgxpool.Stat
}

// UUIDs returns ids as pgx encodes a uuid[] natively: pgtype.UUID values
// go out in binary, while a google/uuid UUID, a driver.Valuer, is encoded
// through its text form one element at a time (a sixth of a lease-mode
// consumer's CPU in the bench's profile). pgtype.UUID is also known to
// pgx's type map without a server round trip, so the simple protocol (a
// PgBouncer in transaction mode) encodes it too.
func UUIDs(ids []uuid.UUID) []pgtype.UUID {
	out := make([]pgtype.UUID, len(ids))
	for i, id := range ids {
		out[i] = pgtype.UUID{Bytes: id, Valid: true}
	}
	return out
}

// UUID is id as pgx encodes it natively (see UUIDs).
func UUID(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

// UUIDDest is where a uuid column scans natively (not through uuid.UUID's
// sql.Scanner and its text form).
func UUIDDest(id *uuid.UUID) *[16]byte { return (*[16]byte)(id) }

// BeginPipelined begins a transaction on db and runs one claim in it: with a
// pool or a conn as one pipelined batch (queue adds the claim, read reads
// its result), otherwise BEGIN then inTx. The returned tx is non-nil
// whenever BEGIN may have happened, also with an error.
func BeginPipelined(ctx context.Context, db Beginner, opts pgx.TxOptions, queue func(*pgx.Batch), read func(pgx.BatchResults) error, inTx func(pgx.Tx) error) (pgx.Tx, error) {
	var send func(context.Context, *pgx.Batch) pgx.BatchResults
	switch db := db.(type) {
	case *pgxpool.Pool:
		send = db.SendBatch
	case *pgx.Conn:
		send = db.SendBatch
	}
	if send == nil {
		// Other Beginners (a pgx.Tx: savepoints) take two round trips.
		var (
			tx  pgx.Tx
			err error
		)
		if b, ok := db.(interface {
			BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
		}); ok && opts != (pgx.TxOptions{}) {
			tx, err = b.BeginTx(ctx, opts)
		} else {
			tx, err = db.Begin(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("begin: %w", err)
		}
		return tx, inTx(tx)
	}
	b := &pgx.Batch{}
	b.BeginTx(opts)
	queue(b)
	br := send(ctx, b)
	tx := br.Tx()
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return tx, fmt.Errorf("begin: %w", err)
	}
	err := read(br)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tx, err
}
