package outboxsql

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// pendingWhere selects the rows of messages m that position ($1: its
// snapshot, $2: its cut's end or NULL, $3: the offset reached in the cut)
// has not passed.
const pendingWhere = `(m.transaction_id >= pg_snapshot_xmax($1::text::pg_snapshot)
		       OR m.transaction_id = ANY (ARRAY(SELECT pg_snapshot_xip($1::text::pg_snapshot))))
		  AND NOT ($2::text IS NOT NULL AND m."offset" <= $3
		           AND pg_visible_in_snapshot(m.transaction_id, $2::text::pg_snapshot))`

// Backlog counts the committed rows name has not forwarded (every row when
// name has no position) and returns how long the oldest of them has been
// waiting, by its created_at (UTC since outbox migration 5) against the
// database's clock in UTC; 0 when none. It is not clamped: a negative age
// (a row written before migration 5 by a session in a zone ahead of UTC)
// is reported as it is.
func (t Tables) Backlog(ctx context.Context, db dbx.Querier, name string) (pending int64, oldest time.Duration, err error) {
	p, err := t.Position(ctx, db, name)
	if errors.Is(err, ErrNoPosition) {
		p, err = Position{Snapshot: Start}, nil
	}
	if err != nil {
		return 0, 0, err
	}
	var cut *string
	if p.Cut != nil {
		s := p.Cut.String()
		cut = &s
	}
	var ageSec float64
	err = db.QueryRow(ctx, `SELECT count(*), COALESCE(EXTRACT(EPOCH FROM (now() AT TIME ZONE 'UTC') - min(m.created_at)), 0)::float8
		FROM `+t.Messages+` m WHERE `+pendingWhere, p.Snapshot.String(), cut, p.CutOffset).Scan(&pending, &ageSec)
	if err != nil {
		return 0, 0, err
	}
	return pending, time.Duration(ageSec * float64(time.Second)), nil
}

// ListedRow is a row of a messages table as an operator sees it: where it
// is, which event, and whether the position has passed it.
type ListedRow struct {
	Offset    int64
	UUID      string
	EventID   string // metadata event_id, "" when none
	Key       string // metadata partition_key, "" when none
	CreatedAt time.Time
	// Pending is true when the position has not passed the row.
	Pending bool
}

// ListRows returns at most limit rows of the messages table with, for each,
// whether p has passed it: the newest first, or with pendingOnly the
// oldest rows p has not passed, first. One query.
func (t Tables) ListRows(ctx context.Context, db dbx.Querier, p Position, pendingOnly bool, limit int) ([]ListedRow, error) {
	var cut *string
	if p.Cut != nil {
		s := p.Cut.String()
		cut = &s
	}
	q := `SELECT m."offset", m.uuid, COALESCE(m.metadata->>'event_id', ''), COALESCE(m.metadata->>'partition_key', ''), m.created_at,
		(` + pendingWhere + `) FROM ` + t.Messages + ` m `
	if pendingOnly {
		q += `WHERE ` + pendingWhere + ` ORDER BY m."offset" LIMIT $4`
	} else {
		q += `ORDER BY m."offset" DESC LIMIT $4`
	}
	rows, err := db.Query(ctx, q, p.Snapshot.String(), cut, p.CutOffset, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (ListedRow, error) {
		var r ListedRow
		err := row.Scan(&r.Offset, &r.UUID, &r.EventID, &r.Key, &r.CreatedAt, &r.Pending)
		return r, err
	})
}
