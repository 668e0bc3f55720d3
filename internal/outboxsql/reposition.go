package outboxsql

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Repositioned is what [Tables.Reposition] did, or would do, in one topic.
type Repositioned struct {
	// Foreign is why the position could not be used: it was from another
	// cluster. nil when it was from this one (it is reset all the same) or
	// when there was none.
	Foreign *ForeignError
	// Resend counts the committed rows in the table, every one of which
	// the forwarder sends again; First and Last are their lowest and
	// highest "offset" (0 when none). Rows of transactions still open are
	// not counted; they are forwarded once they commit.
	Resend, First, Last int64
	// Restamped counts the rows among them whose transaction id is another
	// cluster's (restored with the table): ids that this cluster's
	// snapshots do not see yet, so no cut would take them. Reposition gives
	// them its own transaction's id, which keeps their "offset" order.
	Restamped int64
	// Done is false in a dry run.
	Done bool
}

// Reposition resets name's position (a forwarder's) to the start of the
// table, written on the running cluster, so that every row still in the
// table is forwarded again (the consumers' dedup drops the copies of rows
// already delivered), and reports what it re-sends: the recovery from a
// position of another cluster (after a pg_dump/restore, or a move to a
// logically replicated copy; idemctl outbox reposition). It deletes
// nothing; a running forwarder of that name takes the new position at its
// next transaction. With dryRun it only reports. Run it in a transaction
// (tx): it locks the position as a forwarder does.
func (t Tables) Reposition(ctx context.Context, tx dbx.Querier, name string, dryRun bool) (Repositioned, error) {
	var r Repositioned
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+t.Offsets+` WHERE consumer_group = $1 FOR UPDATE`, name); err != nil {
		return r, fmt.Errorf("lock position: %w", err)
	}
	_, err := t.Position(ctx, tx, name)
	switch {
	case errors.Is(err, ErrNoPosition):
	case errors.As(err, &r.Foreign):
	case err != nil:
		return r, fmt.Errorf("read position: %w", err)
	}
	rows, err := t.Rows(ctx, tx)
	if err != nil {
		return r, fmt.Errorf("count rows: %w", err)
	}
	r.Resend, r.Restamped, r.First, r.Last = rows.Count, rows.Foreign, rows.First, rows.Last
	if dryRun {
		return r, nil
	}
	if r.Restamped > 0 {
		if r.Restamped, err = t.Restamp(ctx, tx); err != nil {
			return r, fmt.Errorf("restamp rows of another cluster: %w", err)
		}
	}
	if err := t.Reset(ctx, tx, name); err != nil {
		return r, fmt.Errorf("reset position: %w", err)
	}
	r.Done = true
	return r, nil
}
