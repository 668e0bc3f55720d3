package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Backlog is what a forwarder group has not yet forwarded from one topic.
type Backlog struct {
	Topic string
	// Pending counts the committed rows after the group's position (all rows
	// when the group has no position yet). Rows of transactions still
	// running are not counted: they are not visible yet.
	Pending int64
	// OldestAge is how long the oldest pending row has been waiting, by its
	// created_at; 0 when nothing is pending.
	OldestAge time.Duration
}

// Backlog reports, for each topic (default: Config.Topics), the rows the
// forwarder group (default: [DefaultForwarderGroup]) has not forwarded yet:
// the outbox lag to alert on. A growing OldestAge with a steady Pending means
// the forwarder is stuck (down, or held back by an old transaction on the
// server: see docs/operations.md).
func (o *Outbox) Backlog(ctx context.Context, db Beginner, group string, topics ...string) ([]Backlog, error) {
	if group == "" {
		group = DefaultForwarderGroup
	}
	if len(topics) == 0 {
		topics = o.cfg.Topics
	}
	out := make([]Backlog, 0, len(topics))
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		for _, topic := range topics {
			if err := o.cfg.validateTopic(topic); err != nil {
				return err
			}
			b := Backlog{Topic: topic}
			var ageSec float64
			err := tx.QueryRow(ctx, `
				WITH pos AS (
					SELECT last_processed_transaction_id AS tx, COALESCE(offset_acked, 0) AS off
					FROM `+o.OffsetsTable(topic)+` WHERE consumer_group = $1)
				SELECT count(*), COALESCE(EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(m.created_at)), 0)::float8
				FROM `+o.MessagesTable(topic)+` m
				WHERE NOT EXISTS (SELECT 1 FROM pos)
				   OR (m.transaction_id, m."offset") > (SELECT tx, off FROM pos)`, group).Scan(&b.Pending, &ageSec)
			if err != nil {
				return fmt.Errorf("outbox: backlog of %s: %w", topic, err)
			}
			if ageSec > 0 {
				b.OldestAge = time.Duration(ageSec * float64(time.Second))
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
