package outboxsql

import (
	"context"
	"fmt"
	"strconv"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Origin is where a position was written: the cluster, and how far its
// transaction ids had gone. A snapshot only means something in the
// transaction-id space it was taken in; after a pg_dump/restore, or a move
// to a logically replicated copy, rows written on the new cluster get ids
// below the stored snapshot's and would count as already forwarded.
type Origin struct {
	// System is the cluster's system identifier (pg_control_system()); 0
	// when unknown: a position written before migration 3, or a
	// watermill-sql subscriber's.
	System int64
	// Xmax bounds the transaction ids the position has seen (full xid8,
	// epoch included): the greatest of the xmax stored with it, its
	// snapshots' xmax and watermill-sql's transaction id. The running
	// cluster's xmax never falls below it.
	Xmax uint64
}

// originColumns read a position's stored Origin, after positionColumns.
const originColumns = `COALESCE(position_system_identifier, 0),
	COALESCE(GREATEST(position_xmax, pg_snapshot_xmax(position_snapshot), pg_snapshot_xmax(cut_snapshot), last_processed_transaction_id), '0')::text`

// originHere is the running cluster's Origin: its system identifier and the
// xmax of the statement's snapshot.
const originHere = `(SELECT system_identifier FROM pg_control_system()), pg_snapshot_xmax(pg_current_snapshot())::text`

// originSet are the columns a write of a position sets to originValues,
// the running cluster's Origin.
const (
	originSet    = `position_system_identifier, position_xmax`
	originValues = `(SELECT system_identifier FROM pg_control_system()), pg_snapshot_xmax(pg_current_snapshot())`
)

// originScan receives an Origin's columns.
type originScan struct {
	system int64
	xmax   string
}

func (o originScan) origin() (Origin, error) {
	x, err := strconv.ParseUint(o.xmax, 10, 64)
	if err != nil {
		return Origin{}, fmt.Errorf("xmax %q: %w", o.xmax, err)
	}
	return Origin{System: o.system, Xmax: x}, nil
}

// ForeignError is returned when a position was not written on the running
// cluster: its system identifier is another cluster's, or its transaction
// ids are ahead of the running cluster's.
type ForeignError struct {
	// Name is the position's name (the forwarder's, or a subscriber's
	// consumer group).
	Name string
	// Stored is the position's Origin, Current the running cluster's.
	Stored, Current Origin
}

func (e *ForeignError) Error() string {
	if e.OtherSystem() {
		return fmt.Sprintf("position %s was written on another PostgreSQL cluster (system identifier %d; this one is %d)", e.Name, e.Stored.System, e.Current.System)
	}
	return fmt.Sprintf("position %s is ahead of this cluster's transaction ids (it has seen xmax %d; this cluster is at %d)", e.Name, e.Stored.Xmax, e.Current.Xmax)
}

// OtherSystem reports whether the system identifiers differ (rather than
// the transaction ids going back).
func (e *ForeignError) OtherSystem() bool {
	return e.Stored.System != 0 && e.Stored.System != e.Current.System
}

// checkOrigin returns a *ForeignError when stored is not from the cluster
// whose origin is current.
func checkOrigin(name string, stored, current originScan) error {
	s, err := stored.origin()
	if err != nil {
		return err
	}
	c, err := current.origin()
	if err != nil {
		return err
	}
	if s.System != 0 && s.System != c.System || s.Xmax > c.Xmax {
		return &ForeignError{Name: name, Stored: s, Current: c}
	}
	return nil
}

// Reset moves name's position (creating it if it has none) to the start of
// the table, written on the running cluster, so that every row still in
// the table is forwarded again.
func (t Tables) Reset(ctx context.Context, db dbx.Querier, name string) error {
	_, err := db.Exec(ctx, `INSERT INTO `+t.Offsets+` (consumer_group, offset_acked, last_processed_transaction_id, position_snapshot, `+originSet+`)
		VALUES ($1, 0, '0', $2::text::pg_snapshot, `+originValues+`)
		ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = 0, last_processed_transaction_id = '0',
			position_snapshot = EXCLUDED.position_snapshot, cut_snapshot = NULL, cut_offset = NULL,
			position_system_identifier = EXCLUDED.position_system_identifier, position_xmax = EXCLUDED.position_xmax`, name, Start.String())
	return err
}

// Rows is what a messages table holds, as [Tables.Rows] counts it.
type Rows struct {
	// Count is the committed rows; Foreign those of them whose transaction
	// id is not visible in the running cluster's snapshot although they
	// committed: ids of another cluster's transactions (restored), which
	// no cut would ever take until this cluster's ids pass them.
	Count, Foreign int64
	// First and Last are the lowest and highest "offset" (0 when none).
	First, Last int64
}

// Rows counts the rows of the messages table db sees.
func (t Tables) Rows(ctx context.Context, db dbx.Querier) (Rows, error) {
	var r Rows
	err := db.QueryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE NOT pg_visible_in_snapshot(transaction_id, pg_current_snapshot())),
			COALESCE(min("offset"), 0), COALESCE(max("offset"), 0)
		FROM `+t.Messages).Scan(&r.Count, &r.Foreign, &r.First, &r.Last)
	return r, err
}

// Restamp gives the rows db sees whose transaction id is not visible in
// the statement's snapshot (see [Rows].Foreign) the id of db's own
// transaction, so that they are forwarded once it commits, in "offset"
// order, and returns how many it changed.
func (t Tables) Restamp(ctx context.Context, db dbx.Querier) (int64, error) {
	tag, err := db.Exec(ctx, `UPDATE `+t.Messages+` SET transaction_id = pg_current_xact_id()
		WHERE NOT pg_visible_in_snapshot(transaction_id, pg_current_snapshot())`)
	return tag.RowsAffected(), err
}
