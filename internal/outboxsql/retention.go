package outboxsql

import (
	"context"
	"math"
	"strconv"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// DeletePassed deletes at most limit rows that every one of positions has
// passed, and returns how many it deleted.
func (t Tables) DeletePassed(ctx context.Context, db dbx.Querier, positions []Position, limit int) (int64, error) {
	if len(positions) == 0 {
		return 0, nil
	}
	snaps := make([]string, len(positions))
	cuts := make([]*string, len(positions))
	offs := make([]int64, len(positions))
	bound := uint64(math.MaxUint64)
	for i, p := range positions {
		snaps[i], offs[i] = p.Snapshot.String(), p.CutOffset
		b := p.Snapshot.Xmax
		if p.Cut != nil {
			c := p.Cut.String()
			cuts[i], b = &c, max(b, p.Cut.Xmax)
		}
		bound = min(bound, b)
	}
	tag, err := db.Exec(ctx, `DELETE FROM `+t.Messages+` WHERE ctid IN (
		SELECT m.ctid FROM `+t.Messages+` m
		WHERE m.transaction_id < $4::text::xid8
		  AND NOT EXISTS (
			SELECT 1 FROM unnest($1::text[], $2::text[], $3::bigint[]) p(snap, cut, off)
			WHERE NOT (pg_visible_in_snapshot(m.transaction_id, p.snap::pg_snapshot)
			           OR p.cut IS NOT NULL AND m."offset" <= p.off
			              AND pg_visible_in_snapshot(m.transaction_id, p.cut::pg_snapshot)))
		LIMIT $5)`, snaps, cuts, offs, strconv.FormatUint(bound, 10), limit)
	return tag.RowsAffected(), err
}
