package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Position is a forwarder's place in a topic: every row whose writing
// transaction is visible in Snapshot has been forwarded; if Cut is set, so
// have the rows of the cut (Snapshot, Cut] whose "offset" is at most
// CutOffset, and the forwarder is part way through that cut.
type Position struct {
	Snapshot Snapshot
	// Cut is the snapshot ending the cut in progress, nil when none is.
	Cut *Snapshot
	// CutOffset is the "offset" of the last row of the cut forwarded.
	CutOffset int64
}

// watermillSQLPosition is the Position of watermill-sql's (transaction_id,
// offset) position, left by its own subscribers and forwarder: rows up to
// (txID, offset) in (transaction_id, offset) order, all of whose
// transactions had ended (watermill-sql reads only below the snapshot's
// xmin). Every transaction below
// txID is visible in the snapshot txID:txID:, and the cut up to
// txID+1:txID+1: is txID's rows, forwarded up to offset.
func watermillSQLPosition(txID uint64, offset int64) Position {
	if txID < Start.Xmax {
		return Position{Snapshot: Start}
	}
	cut := Snapshot{Xmin: txID + 1, Xmax: txID + 1}
	return Position{Snapshot: Snapshot{Xmin: txID, Xmax: txID}, Cut: &cut, CutOffset: offset}
}

// watermillSQLColumns returns watermill-sql's (transaction_id, offset)
// position that p has certainly passed: every transaction below
// p.Snapshot's xmin. The forwarder keeps those columns up to date with it,
// so that watermill-sql's own forwarder or subscriber, run on the tables in
// its place, resends only what is above it.
func watermillSQLColumns(p Position) (txID uint64, offset int64) {
	if p.Snapshot.Xmin <= Start.Xmin {
		return 0, 0
	}
	return p.Snapshot.Xmin - 1, math.MaxInt64
}

// Register inserts name's position at the start of the table unless it has
// one, so that [Tables.BeginLock] has a row to lock.
func (t Tables) Register(ctx context.Context, db dbx.Querier, name string) error {
	_, err := db.Exec(ctx, `INSERT INTO `+t.Offsets+` (consumer_group, offset_acked, last_processed_transaction_id, position_snapshot, `+originSet+`)
		VALUES ($1, 0, '0', $2::text::pg_snapshot, `+originValues+`) ON CONFLICT (consumer_group) DO NOTHING`, name, Start.String())
	return err
}

const positionColumns = `position_snapshot::text, cut_snapshot::text, cut_offset, last_processed_transaction_id::text, COALESCE(offset_acked, 0)`

func scanPosition(row pgx.Row, extra ...any) (Position, error) {
	var (
		snap, cut *string
		cutOffset *int64
		wsqlTx    string
		wsqlOff   int64
	)
	if err := row.Scan(append([]any{&snap, &cut, &cutOffset, &wsqlTx, &wsqlOff}, extra...)...); err != nil {
		return Position{}, err
	}
	if snap == nil {
		tx, err := strconv.ParseUint(wsqlTx, 10, 64)
		if err != nil {
			return Position{}, fmt.Errorf("last_processed_transaction_id %q: %w", wsqlTx, err)
		}
		return watermillSQLPosition(tx, wsqlOff), nil
	}
	var p Position
	var err error
	if p.Snapshot, err = ParseSnapshot(*snap); err != nil {
		return Position{}, err
	}
	if cut != nil {
		c, err := ParseSnapshot(*cut)
		if err != nil {
			return Position{}, err
		}
		p.Cut = &c
		if cutOffset != nil {
			p.CutOffset = *cutOffset
		}
	}
	return p, nil
}

// Position reads name's position without locking it, or returns
// [ErrNoPosition], or a [*ForeignError] when the position is not from the
// running cluster.
func (t Tables) Position(ctx context.Context, db dbx.Querier, name string) (Position, error) {
	var stored, current originScan
	p, err := scanPosition(db.QueryRow(ctx, `SELECT `+positionColumns+`, `+originColumns+`, `+originHere+` FROM `+t.Offsets+` WHERE consumer_group = $1`, name),
		&stored.system, &stored.xmax, &current.system, &current.xmax)
	if errors.Is(err, pgx.ErrNoRows) {
		return Position{}, ErrNoPosition
	}
	if err == nil {
		err = checkOrigin(name, stored, current)
	}
	if err != nil {
		return Position{}, err
	}
	return p, nil
}

// ErrNoPosition is returned by [Tables.Position], [Tables.Positions],
// [Tables.BeginLock] and [Tables.Ack] when a name has no position.
var ErrNoPosition = errors.New("no position")

// Positions returns the positions of names (duplicates once), or
// [ErrNoPosition] if one of them has none.
func (t Tables) Positions(ctx context.Context, db dbx.Querier, names []string) ([]Position, error) {
	names = slices.Compact(slices.Sorted(slices.Values(names)))
	out := make([]Position, 0, len(names))
	for _, n := range names {
		p, err := t.Position(ctx, db, n)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}
