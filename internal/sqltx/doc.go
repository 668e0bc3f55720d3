// Package sqltx runs the library's pgx statements on a *sql.DB opened with
// pgx's database/sql driver (github.com/jackc/pgx/v5/stdlib), inside the
// database/sql transaction a handler sees.
//
// A transaction begins through database/sql (db.Conn, then Conn.BeginTx),
// so the handler gets a real *sql.Tx that GORM, bun, ent, sqlx or sqlc
// accept; the library's own statements (claim, outbox rows, lease
// completion) run on the *pgx.Conn under the same session, reached with
// sql.Conn.Raw and stdlib.Conn.Conn: the same connection, the same
// transaction, no second session. [SQL] gives the *sql.Tx back from the
// pgx.Tx the library works with.
//
// # Round trips
//
// database/sql sends BEGIN on its own (driver.ConnBeginTx has no way to
// queue a statement behind it), so a transaction that begins with a claim
// costs one round trip more than on a pgxpool.Pool, where BEGIN and the
// claim travel pipelined. Statements outside a transaction (a lease's take,
// renew and release batches) cost the same as on a pool.
//
// # Drivers
//
// Only pgx's stdlib driver is accepted: the library's statements are pgx
// statements (pgx batches and native types), and no other driver exposes a
// pgx connection. Another driver (lib/pq, say) is refused by [New] with
// [ErrUnsupportedDriver].
package sqltx
