package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
)

// errLockBusy is a forwarder transaction's wait for another instance's
// lock on the position that ran out of lock_timeout: not a failure, the
// other instance is forwarding the topic.
var errLockBusy = errors.New("outbox: position locked by another forwarder")

// logHolder logs who holds the position's lock: at Info the first time a
// holder is seen (one line per takeover), at Debug while it keeps it.
// last is the pid logged before.
func (f *Forwarder) logHolder(ctx context.Context, tables outboxsql.Tables, logger watermill.LoggerAdapter, last *int32) {
	qctx, cancel := context.WithTimeout(ctx, lockWait)
	defer cancel()
	h, ok, err := tables.LockHolder(qctx, f.cfg.DB, f.cfg.Name)
	switch {
	case err != nil:
		if ctx.Err() == nil {
			logger.Debug("Outbox position is locked by another forwarder; cannot read the holder", watermill.LogFields{"err": err.Error()})
		}
		return
	case !ok:
		return // released meanwhile: the next transaction takes it
	}
	fields := watermill.LogFields{
		"holder_pid": h.PID, "holder_addr": h.Addr, "holder_application": h.Application,
		"holder_state": h.State, "holder_state_for": h.Idle.Round(time.Millisecond).String(),
		"holder_transaction_for": h.InTransaction.Round(time.Millisecond).String(),
	}
	if lim := f.cfg.limits(); lim.Idle > 0 {
		fields["released_after_idle"] = lim.Idle.String()
	}
	msg := "Outbox position is locked by another forwarder of the same name, waiting for it"
	if h.PID == *last {
		logger.Debug(msg, fields)
		return
	}
	*last = h.PID
	logger.Info(msg, fields)
}

// checkServerTimeouts reads the session's timeouts, which a database-wide
// or role setting gives every forwarder transaction, and explains at
// start-up those that disagree with SendTimeout.
func (f *Forwarder) checkServerTimeouts(ctx context.Context) error {
	rows, err := f.cfg.DB.Query(ctx, `SELECT name, setting::bigint FROM pg_settings
		WHERE name IN ('idle_in_transaction_session_timeout', 'transaction_timeout')`)
	if err != nil {
		return fmt.Errorf("outbox forwarder: read the server's timeouts: %w", err)
	}
	settings := map[string]time.Duration{}
	for rows.Next() {
		var (
			name string
			v    int64
		)
		if err := rows.Scan(&name, &v); err != nil {
			rows.Close()
			return fmt.Errorf("outbox forwarder: read the server's timeouts: %w", err)
		}
		settings[name] = time.Duration(v) * time.Millisecond
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("outbox forwarder: read the server's timeouts: %w", err)
	}
	for _, n := range timeoutNotes(f.cfg, settings) {
		if n.bad {
			f.logger.Error(n.text, nil, nil)
		} else {
			f.logger.Info(n.text, nil)
		}
	}
	return nil
}

type timeoutNote struct {
	text string
	bad  bool // the setting ends transactions that are working
}

// timeoutNotes explains the session's timeouts (in settings, 0 = none) for
// a forwarder of cfg.
func timeoutNotes(cfg ForwarderConfig, settings map[string]time.Duration) []timeoutNote {
	var notes []timeoutNote
	lim := cfg.limits()
	idle := settings["idle_in_transaction_session_timeout"]
	switch {
	case lim.Idle > 0 && idle > 0 && idle < lim.Idle:
		notes = append(notes, timeoutNote{text: fmt.Sprintf("Outbox forwarder: the database's idle_in_transaction_session_timeout (%s) is shorter than a send to the broker may take (SendTimeout %s): "+
			"the forwarder's transactions set their own (%s, SET LOCAL), so a slow send does not end them", idle, cfg.SendTimeout, lim.Idle)})
	case lim.Idle == 0 && idle > 0:
		notes = append(notes, timeoutNote{text: fmt.Sprintf("Outbox forwarder: SendTimeout is negative, so the database's idle_in_transaction_session_timeout (%s) applies: "+
			"a send that takes longer ends its transaction, which is rolled back and its pages sent again", idle)})
	case lim.Idle == 0:
		notes = append(notes, timeoutNote{text: "Outbox forwarder: SendTimeout is negative and the database has no idle_in_transaction_session_timeout: " +
			"an instance whose host vanishes without a TCP reset keeps the position's lock, and the topic stops, until the kernel gives up on its connection (hours)"})
	}
	// transaction_timeout (PostgreSQL 17) bounds a whole transaction, and a
	// transaction may send BatchesPerTransaction pages.
	if tt := settings["transaction_timeout"]; tt > 0 && cfg.SendTimeout > 0 {
		if longest := time.Duration(cfg.BatchesPerTransaction) * cfg.SendTimeout; tt < longest {
			notes = append(notes, timeoutNote{bad: true, text: fmt.Sprintf("Outbox forwarder: the database's transaction_timeout (%s) is shorter than a forwarder transaction may last "+
				"(BatchesPerTransaction %d × SendTimeout %s = %s): a transaction whose sends are slow is ended and its pages are sent again, each time; "+
				"set transaction_timeout to 0 or above %s for the forwarder's role (ALTER ROLE ... SET transaction_timeout = ...), or lower BatchesPerTransaction",
				tt, cfg.BatchesPerTransaction, cfg.SendTimeout, longest, longest)})
		}
	}
	return notes
}
