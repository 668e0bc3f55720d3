package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
)

// Limits are the server-side limits of one forwarder transaction, set
// with SET LOCAL by [Tables.BeginLock] (zero: the session's own setting).
type Limits struct {
	// Idle is the transaction's idle_in_transaction_session_timeout and
	// tcp_user_timeout: the server ends the session, and so releases the
	// position's lock, when its client has been silent (the transaction
	// idle) or has not acknowledged data for that long: a holder whose
	// host vanished without a TCP reset.
	Idle time.Duration
	// Lock is the transaction's lock_timeout: how long it waits for
	// another holder's lock on the position before it gives up with
	// SQLSTATE 55P03 (see [IsLockTimeout]).
	Lock time.Duration
}

// limitsSQL sets [Limits] for the rest of the transaction; an empty value
// leaves a setting as it is.
const limitsSQL = `SELECT
	CASE WHEN $1::text = '' THEN '' ELSE set_config('idle_in_transaction_session_timeout', $1, true) || set_config('tcp_user_timeout', $1, true) END,
	CASE WHEN $2::text = '' THEN '' ELSE set_config('lock_timeout', $2, true) END`

// ms renders d as a setting in milliseconds, "" for zero or less.
func ms(d time.Duration) string {
	if d <= 0 {
		return ""
	}
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10)
}

// IsLockTimeout reports whether err is a lock wait that ran out of
// lock_timeout (SQLSTATE 55P03).
func IsLockTimeout(err error) bool {
	return pgerr.Has(err, pgerrcode.LockNotAvailable)
}

// Holder is the session that holds a forwarder's position lock, as
// pg_stat_activity shows it (fields it hides from a role without
// pg_read_all_stats are empty).
type Holder struct {
	PID int32
	// Addr is the client's address, "local" for a Unix socket.
	Addr, Application, State string
	// InTransaction is how long its transaction has run, Idle how long it
	// has been in State.
	InTransaction, Idle time.Duration
}

func (h Holder) String() string {
	return fmt.Sprintf("pid %d at %s (application %q), %s for %s, transaction open for %s",
		h.PID, h.Addr, h.Application, h.State, h.Idle.Round(time.Millisecond), h.InTransaction.Round(time.Millisecond))
}

// holderSQL finds the transaction whose id is the xmax of name's position
// row, the one that locked it FOR UPDATE, among the running sessions.
const holderSQL = `SELECT a.pid, coalesce(host(a.client_addr), CASE WHEN a.client_port = -1 THEN 'local' END, ''),
		coalesce(a.application_name, ''), coalesce(a.state, ''),
		coalesce(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8,
		coalesce(extract(epoch FROM clock_timestamp() - a.state_change), 0)::float8
	FROM %s o
	JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = o.xmax AND l.granted AND l.mode = 'ExclusiveLock'
	JOIN pg_stat_activity a ON a.pid = l.pid
	WHERE o.consumer_group = $1`

// LockHolder returns the session that holds name's position lock, and
// false when none does (it ended meanwhile).
func (t Tables) LockHolder(ctx context.Context, db dbx.Querier, name string) (Holder, bool, error) {
	var (
		h          Holder
		xact, idle float64
	)
	err := db.QueryRow(ctx, fmt.Sprintf(holderSQL, t.Offsets), name).Scan(&h.PID, &h.Addr, &h.Application, &h.State, &xact, &idle)
	if errors.Is(err, pgx.ErrNoRows) {
		return Holder{}, false, nil
	}
	if err != nil {
		return Holder{}, false, err
	}
	h.InTransaction = time.Duration(xact * float64(time.Second))
	h.Idle = time.Duration(idle * float64(time.Second))
	return h, true, nil
}
