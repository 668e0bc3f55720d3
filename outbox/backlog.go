package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// Backlog is what a forwarder has not yet forwarded from one topic.
type Backlog struct {
	Topic string
	// Forwarder is the forwarder whose position counts
	// ([BacklogOpts.Forwarder]).
	Forwarder string
	// Pending counts the committed rows after the forwarder's position (all
	// rows when it has no position yet). Rows of transactions still running
	// are not counted: they are not visible yet.
	Pending int64
	// OldestAge is how long the oldest pending row has been waiting, by its
	// created_at against the database's clock, both in UTC (outbox
	// migration 5), whatever the writers' and the reader's time zones; 0
	// when nothing is pending. It is never clamped: a row written before
	// migration 5 by a session in another zone is off by that zone's
	// offset (negative ahead of UTC, hours too old behind it), shown as it
	// is rather than hidden as 0.
	OldestAge time.Duration
	// Dead counts the rows in the topic's dead table: rows no forwarder
	// could send and the rows held behind them. Above zero, an operator
	// has something to do (idemctl outbox dead list, docs/outbox.md).
	Dead int64
}

// BacklogOpts selects what [Outbox.Backlog] reports. A nil *BacklogOpts
// takes every default.
type BacklogOpts struct {
	// Forwarder is the [ForwarderConfig.Name] whose position counts.
	// Defaults to [DefaultForwarderName].
	Forwarder string
	// Topics to report, in this order. Defaults to the Outbox's
	// Config.Topics.
	Topics []string
}

// Backlog reports, for each topic, the rows the forwarder has not forwarded
// yet: the outbox lag to alert on. A growing OldestAge with a steady Pending
// means the forwarder is stuck (down, or held back by an old transaction on
// the server: see docs/operations.md). It reads every topic in one
// transaction on db. A position from another cluster (see [PositionError])
// is refused with a *PositionError: the rows it would call forwarded are
// not.
func (o *Outbox) Backlog(ctx context.Context, db migrate.Beginner, opts *BacklogOpts) ([]Backlog, error) {
	var forwarder string
	topics := o.cfg.Topics
	if opts != nil {
		forwarder = opts.Forwarder
		if len(opts.Topics) > 0 {
			topics = opts.Topics
		}
	}
	if forwarder == "" {
		forwarder = DefaultForwarderName
	}
	for _, topic := range topics {
		if err := o.cfg.validateTopic(topic); err != nil {
			return nil, err
		}
	}
	out := make([]Backlog, 0, len(topics))
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		for _, topic := range topics {
			b := Backlog{Topic: topic, Forwarder: forwarder}
			var err error
			if b.Pending, b.OldestAge, err = o.tables(topic).Backlog(ctx, tx, forwarder); err != nil {
				if pe := positionError(err, topic); pe != err {
					return pe
				}
				return fmt.Errorf("outbox: backlog of %s: %w", topic, err)
			}
			if b.Dead, err = o.tables(topic).DeadCount(ctx, tx); err != nil {
				return fmt.Errorf("outbox: dead rows of %s: %w", topic, err)
			}
			out = append(out, b)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
