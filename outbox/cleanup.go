package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// defaultDeleteBatch is how many rows one DeleteForwarded statement removes.
const defaultDeleteBatch = 5000

// DeleteForwardedOpts selects what [Outbox.DeleteForwarded] deletes. A nil
// *DeleteForwardedOpts takes every default.
type DeleteForwardedOpts struct {
	// Forwarders are the positions a row must be behind, in every one of
	// them, to be deleted: the [ForwarderConfig.Name] of each forwarder of
	// the tables, and the consumer group of any watermill-sql Subscriber
	// reading them (their positions share the offsets table). One of them
	// without a position keeps every row. Defaults to
	// [DefaultForwarderName] alone.
	Forwarders []string
	// Topics whose tables are pruned, in this order. Defaults to the
	// Outbox's Config.Topics.
	Topics []string
	// BatchSize is the most rows one DELETE statement removes; each runs in
	// its own short transaction. Defaults to 5000.
	BatchSize int
}

// DeleteForwarded deletes, for each topic, the rows that every one of the
// forwarders has already passed, and returns how many it deleted. Run it
// periodically: the forwarder never deletes, since another forwarder or
// subscriber may still need the rows. When ctx is done between two
// statements, it returns what it deleted so far with ctx's error. When one
// of the positions is from another cluster (see [PositionError]), it
// deletes nothing from that topic and returns a *PositionError.
func (o *Outbox) DeleteForwarded(ctx context.Context, db migrate.Beginner, opts *DeleteForwardedOpts) (int64, error) {
	var opt DeleteForwardedOpts
	if opts != nil {
		opt = *opts
	}
	if opt.BatchSize < 0 {
		return 0, errors.New("outbox: DeleteForwardedOpts.BatchSize: must not be negative")
	}
	if opt.BatchSize == 0 {
		opt.BatchSize = defaultDeleteBatch
	}
	if len(opt.Forwarders) == 0 {
		opt.Forwarders = []string{DefaultForwarderName}
	}
	if len(opt.Topics) == 0 {
		opt.Topics = o.cfg.Topics
	}
	for _, topic := range opt.Topics {
		if err := o.cfg.validateTopic(topic); err != nil {
			return 0, err
		}
	}
	var total int64
	for _, topic := range opt.Topics {
		n, err := o.deleteForwarded(ctx, db, topic, opt)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

func (o *Outbox) deleteForwarded(ctx context.Context, db migrate.Beginner, topic string, opts DeleteForwardedOpts) (int64, error) {
	tables := o.tables(topic)
	var positions []outboxsql.Position
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) (err error) {
		positions, err = tables.Positions(ctx, tx, opts.Forwarders)
		return err
	})
	if errors.Is(err, outboxsql.ErrNoPosition) {
		return 0, nil
	}
	if err != nil {
		if pe := positionError(err, topic); pe != err {
			return 0, pe
		}
		return 0, fmt.Errorf("outbox: read positions of %s: %w", topic, err)
	}
	var total int64
	for {
		var n int64
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) (err error) {
			n, err = tables.DeletePassed(ctx, tx, positions, opts.BatchSize)
			return err
		})
		if err != nil {
			return total, fmt.Errorf("outbox: delete forwarded rows of %s: %w", topic, err)
		}
		total += n
		if n < int64(opts.BatchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("outbox: delete forwarded rows of %s: %w", topic, err)
		}
	}
}
