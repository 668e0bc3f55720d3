package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// RepositionOpts selects what [Outbox.Reposition] resets. A nil
// *RepositionOpts takes every default.
type RepositionOpts struct {
	// Forwarder is the [ForwarderConfig.Name] whose position is reset.
	// Defaults to [DefaultForwarderName].
	Forwarder string
	// Topics to reset, in this order. Defaults to the Outbox's
	// Config.Topics.
	Topics []string
	// DryRun reports what would be re-sent and changes nothing. Defaults
	// to false.
	DryRun bool
}

// Reposition is what [Outbox.Reposition] did, or would do, in one topic.
type Reposition struct {
	Topic, Forwarder string
	// Problem is why the position could not be used: a *PositionError
	// when it was from another cluster, nil when it was from this one (it
	// is reset all the same) or when there was none.
	Problem error
	// Resend counts the committed rows in the table, every one of which
	// the forwarder sends again; First and Last are their lowest and
	// highest "offset" (0 when none). Rows of transactions still open
	// are not counted; they are forwarded once they commit.
	Resend, First, Last int64
	// Restamped counts the rows among them whose transaction id is another
	// cluster's (restored with the table): ids that this cluster's
	// snapshots do not see yet, so no cut would take them. Reposition gives
	// them its own transaction's id, which keeps their "offset" order.
	Restamped int64
	// Done is false in a dry run.
	Done bool
}

// Reposition resets the forwarder's position in each topic to the start of
// the table, written on the running cluster, so that every row still in
// the table is forwarded again (the consumers' dedup drops the copies of
// rows already delivered), and returns, per topic, what it re-sends. It is
// the recovery from a [*PositionError] (after a pg_dump/restore or a move
// to a logically replicated copy), and the way to force a re-forward. It
// deletes nothing; a running forwarder of that name takes the new position
// at its next transaction. With DryRun it only reports. Each topic is reset
// in its own transaction, which locks the position as a forwarder does.
func (o *Outbox) Reposition(ctx context.Context, db migrate.Beginner, opts *RepositionOpts) ([]Reposition, error) {
	var opt RepositionOpts
	if opts != nil {
		opt = *opts
	}
	if opt.Forwarder == "" {
		opt.Forwarder = DefaultForwarderName
	}
	if len(opt.Topics) == 0 {
		opt.Topics = o.cfg.Topics
	}
	for _, topic := range opt.Topics {
		if err := o.cfg.validateTopic(topic); err != nil {
			return nil, err
		}
	}
	out := make([]Reposition, 0, len(opt.Topics))
	for _, topic := range opt.Topics {
		r := Reposition{Topic: topic, Forwarder: opt.Forwarder}
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			return o.reposition(ctx, tx, &r, opt.DryRun)
		})
		if err != nil {
			return out, fmt.Errorf("outbox: reposition %s in %s: %w", opt.Forwarder, topic, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func (o *Outbox) reposition(ctx context.Context, tx pgx.Tx, r *Reposition, dryRun bool) error {
	tables := o.tables(r.Topic)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+tables.Offsets+` WHERE consumer_group = $1 FOR UPDATE`, r.Forwarder); err != nil {
		return fmt.Errorf("lock position: %w", err)
	}
	_, err := tables.Position(ctx, tx, r.Forwarder)
	switch {
	case errors.Is(err, outboxsql.ErrNoPosition):
	case err != nil:
		if pe := positionError(err, r.Topic); pe != err {
			r.Problem = pe
		} else {
			return fmt.Errorf("read position: %w", err)
		}
	}
	rows, err := tables.Rows(ctx, tx)
	if err != nil {
		return fmt.Errorf("count rows: %w", err)
	}
	r.Resend, r.Restamped, r.First, r.Last = rows.Count, rows.Foreign, rows.First, rows.Last
	if dryRun {
		return nil
	}
	if r.Restamped > 0 {
		if r.Restamped, err = tables.Restamp(ctx, tx); err != nil {
			return fmt.Errorf("restamp rows of another cluster: %w", err)
		}
	}
	if err := tables.Reset(ctx, tx, r.Forwarder); err != nil {
		return fmt.Errorf("reset position: %w", err)
	}
	r.Done = true
	return nil
}
