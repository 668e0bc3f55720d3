package sqltx_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	_ "github.com/lib/pq" // another database/sql driver, to be refused
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/sqltx"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

func newDB(t *testing.T) (*pgtest.DB, *sql.DB, *sqltx.DB) {
	t.Helper()
	pdb := pgtest.New(t, 1)
	sdb := pdb.SQLDB(t, 2, nil)
	db, err := sqltx.New(sdb)
	require.NoError(t, err)
	pdb.Exec(t, "CREATE TABLE t (v int)")
	return pdb, sdb, db
}

// The pgx.Tx and the *sql.Tx are one transaction on one session: each
// sees the other's uncommitted writes, and they commit or roll back
// together; the connection goes back to the pool.
func TestTxIsOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pdb, sdb, db := newDB(t)
	for _, commit := range []bool{false, true} {
		tx, err := db.Begin(ctx)
		require.NoError(t, err)
		stx, ok := sqltx.SQL(tx)
		require.True(t, ok)
		_, err = tx.Exec(ctx, "INSERT INTO t VALUES (1)")
		require.NoError(t, err)
		_, err = stx.ExecContext(ctx, "INSERT INTO t VALUES (2)")
		require.NoError(t, err)
		var n int
		require.NoError(t, stx.QueryRowContext(ctx, "SELECT count(*) FROM t").Scan(&n))
		require.Equal(t, 2, n)
		require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n))
		require.Equal(t, 2, n)
		require.Zero(t, pdb.Count(t, "SELECT 1 FROM t"), "nothing visible outside before COMMIT")
		if commit {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
		require.ErrorIs(t, tx.Rollback(ctx), pgx.ErrTxClosed)
		require.ErrorIs(t, tx.Commit(ctx), pgx.ErrTxClosed)
		require.Zero(t, sdb.Stats().InUse)
	}
	require.Equal(t, 2, pdb.Count(t, "SELECT 1 FROM t"))
}

// A transaction that failed commits as a rollback (pgx's rule), through
// database/sql.
func TestCommitOfAFailedTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pdb, sdb, db := newDB(t)
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "INSERT INTO t VALUES (1)")
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT 1/0")
	require.Error(t, err)
	require.ErrorIs(t, tx.Commit(ctx), pgx.ErrTxCommitRollback)
	require.Zero(t, pdb.Count(t, "SELECT 1 FROM t"))
	require.Zero(t, sdb.Stats().InUse)
}

// A statement cancelled by its context kills pgx's connection; the *sql.DB
// drops it and goes on with a new one.
func TestCancelledStatementLeavesThePoolUsable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, sdb, db := newDB(t)
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = tx.Exec(cctx, "SELECT pg_sleep(10)")
	require.Error(t, err)
	_ = tx.Rollback(ctx)
	require.Zero(t, sdb.Stats().InUse)
	var one int
	require.NoError(t, db.QueryRow(ctx, "SELECT 1").Scan(&one))
	require.Equal(t, 1, one)
}

// Statements and batches outside a transaction hold a connection only
// until their results are read or closed.
func TestPoolStatementsReleaseTheirConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, sdb, db := newDB(t)
	_, err := db.Exec(ctx, "INSERT INTO t VALUES (1), (2)")
	require.NoError(t, err)
	rows, err := db.Query(ctx, "SELECT v FROM t ORDER BY v")
	require.NoError(t, err)
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	require.Equal(t, []int32{1, 2}, vs)
	require.ErrorIs(t, db.QueryRow(ctx, "SELECT v FROM t WHERE v = 3").Scan(new(int32)), pgx.ErrNoRows)
	rows, err = db.Query(ctx, "SELECT v FROM t")
	require.NoError(t, err)
	for rows.Next() { // read to the end without Close
	}
	b := &pgx.Batch{}
	b.Queue("INSERT INTO t VALUES (3)")
	b.Queue("SELECT count(*) FROM t")
	br := db.SendBatch(ctx, b)
	_, err = br.Exec()
	require.NoError(t, err)
	var n int
	require.NoError(t, br.QueryRow().Scan(&n))
	require.Equal(t, 3, n)
	require.NoError(t, br.Close())
	require.Zero(t, sdb.Stats().InUse)
}

// Options map to database/sql's; what it cannot say is refused.
func TestTxOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, db := newDB(t)
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly})
	require.NoError(t, err)
	var iso, ro string
	require.NoError(t, tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')").Scan(&iso, &ro))
	require.Equal(t, "serializable", iso)
	require.Equal(t, "on", ro)
	require.NoError(t, tx.Rollback(ctx))
	_, err = db.BeginTx(ctx, pgx.TxOptions{DeferrableMode: pgx.Deferrable})
	require.Error(t, err)
	_, err = tx.Begin(ctx)
	require.Error(t, err, "no pgx savepoints")
}

// Only pgx's driver is accepted.
func TestOtherDriversRefused(t *testing.T) {
	t.Parallel()
	pq, err := sql.Open("postgres", pgtest.URL())
	require.NoError(t, err)
	defer pq.Close()
	_, err = sqltx.New(pq)
	require.ErrorIs(t, err, sqltx.ErrUnsupportedDriver)
	_, err = sqltx.New(nil)
	require.Error(t, err)
	require.False(t, errors.Is(err, sqltx.ErrUnsupportedDriver))
}
