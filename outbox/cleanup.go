package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// DefaultDeleteBatch is how many rows one DeleteForwarded statement removes.
const DefaultDeleteBatch = 5000

// DeleteForwarded deletes the rows of topic that every one of groups (the
// forwarders' ConsumerGroup, and any watermill-sql subscriber group reading
// the table; defaults to [DefaultForwarderGroup]) has already passed, in
// statements of at most batch rows (0 means [DefaultDeleteBatch]), each in
// its own short transaction, and returns how many it deleted. A group that
// has no position yet keeps every row. Run it periodically (the forwarder
// never deletes: another group may still need the rows).
func (o *Outbox) DeleteForwarded(ctx context.Context, db Beginner, topic string, batch int, groups ...string) (int64, error) {
	if err := o.cfg.validateTopic(topic); err != nil {
		return 0, err
	}
	if batch <= 0 {
		batch = DefaultDeleteBatch
	}
	if len(groups) == 0 {
		groups = []string{DefaultForwarderGroup}
	}
	var txID string
	var offset int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var n int
		err := tx.QueryRow(ctx, `SELECT count(*) FROM `+o.OffsetsTable(topic)+` WHERE consumer_group = ANY($1)`, groups).Scan(&n)
		if err != nil {
			return err
		}
		if n < len(groups) {
			return errNoPosition
		}
		// The lowest position in (transaction_id, offset) order.
		return tx.QueryRow(ctx, `SELECT last_processed_transaction_id::text, offset_acked FROM `+o.OffsetsTable(topic)+`
			WHERE consumer_group = ANY($1) ORDER BY last_processed_transaction_id, offset_acked LIMIT 1`, groups).Scan(&txID, &offset)
	})
	if errors.Is(err, errNoPosition) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("outbox: read positions of %s: %w", topic, err)
	}
	var total int64
	for {
		tag, err := execInTx(ctx, db, `DELETE FROM `+o.MessagesTable(topic)+` WHERE ctid IN (
			SELECT ctid FROM `+o.MessagesTable(topic)+` WHERE (transaction_id, "offset") <= ($1::xid8, $2) LIMIT $3)`, txID, offset, batch)
		if err != nil {
			return total, fmt.Errorf("outbox: delete forwarded rows of %s: %w", topic, err)
		}
		total += tag
		if tag < int64(batch) || ctx.Err() != nil {
			return total, ctx.Err()
		}
	}
}

var errNoPosition = errors.New("a group has no position")

func execInTx(ctx context.Context, db Beginner, sql string, args ...any) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sql, args...)
		n = tag.RowsAffected()
		return err
	})
	return n, err
}
