package outboxsql

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Page is a run of consecutive rows of a cut in "offset" order: exactly the
// rows of the transactions TxIDs whose "offset" is between First and Last.
type Page struct {
	First, Last int64
	TxIDs       []uint64
	// Rows counts them.
	Rows int
}

// Cut is the rows of the transactions visible in To and not in From whose
// "offset" is above After, split into pages in "offset" order.
type Cut struct {
	From, To Snapshot
	After    int64
	Pages    []Page
}

// cutSQL is a statement over the rows of the cut from $1 to its end
// snapshot e.snap ($2, or when $2 is NULL the statement's own snapshot)
// after "offset" $3: the rows whose transaction is visible in the end and
// not in $1, which is either at or above $1's xmax, or among $1's running
// ones. Each of the two is an index-only range of the primary key, so the
// cost follows the cut, not the table nor transactions held open
// elsewhere; the end snapshot is computed once per statement, not per row.
// The statement is "WITH e ..., c AS (the cut's keys) " + query, where
// query reads c (transaction_id, "offset") and e (snap).
func cutSQL(messages, query string) string {
	return cutSQLFrom(messages, `SELECT COALESCE($2::text::pg_snapshot, pg_current_snapshot()) AS snap`, query)
}

// cutSQLFrom is cutSQL with e given as a query returning snap.
func cutSQLFrom(messages, end, query string) string {
	return `WITH e AS MATERIALIZED (` + end + `),
		c AS (
			SELECT m.transaction_id, m."offset" FROM ` + messages + ` m
			WHERE m.transaction_id >= pg_snapshot_xmax($1::text::pg_snapshot)
			  AND m.transaction_id < pg_snapshot_xmax((SELECT snap FROM e))
			  AND pg_visible_in_snapshot(m.transaction_id, (SELECT snap FROM e))
			  AND m."offset" > $3
			UNION ALL
			SELECT m.transaction_id, m."offset" FROM ` + messages + ` m
			WHERE m.transaction_id = ANY (ARRAY(SELECT pg_snapshot_xip($1::text::pg_snapshot)))
			  AND pg_visible_in_snapshot(m.transaction_id, (SELECT snap FROM e))
			  AND m."offset" > $3)
		` + query
}

// CutSQL is the statement of [Tables.ReadCut]: the keys of the cut's rows,
// one row per transaction with its rows' "offset"s (in no particular
// order: sorting them costs less in the client than in the server), each
// with the cut's end snapshot.
func CutSQL(messages string) string {
	return cutSQL(messages, `SELECT c.transaction_id::text, array_agg(c."offset"), (SELECT snap::text FROM e) FROM c GROUP BY c.transaction_id`)
}

// ReadCut returns the pages (of at most pageSize rows) of the cut that
// continues p: the rest of p.Cut after p.CutOffset, or, when p has no cut,
// a new cut from p.Snapshot to the snapshot of this statement (To; a cut
// without rows has no pages and To is then meaningless). It reads only
// the keys of the rows, 16 bytes each; [Tables.ReadPage] reads a page's
// rows.
func (t Tables) ReadCut(ctx context.Context, db dbx.Querier, p Position, pageSize int) (Cut, error) {
	c := Cut{From: p.Snapshot}
	var to *string
	if p.Cut != nil {
		s := p.Cut.String()
		to, c.To, c.After = &s, *p.Cut, p.CutOffset
	}
	rows, err := db.Query(ctx, CutSQL(t.Messages), p.Snapshot.String(), to, c.After)
	if err != nil {
		return c, err
	}
	return t.scanCut(c, p, rows, pageSize)
}

// scanCut reads the cut statement's rows into c, in pages of pageSize.
func (t Tables) scanCut(c Cut, p Position, rows pgx.Rows, pageSize int) (Cut, error) {
	defer rows.Close()
	type key struct {
		offset int64
		xid    uint64
	}
	var (
		cur     string
		keys    []key
		xidText string
		offsets []int64
	)
	for rows.Next() {
		if err := rows.Scan(&xidText, &offsets, &cur); err != nil {
			return c, err
		}
		xid, err := strconv.ParseUint(xidText, 10, 64)
		if err != nil {
			return c, fmt.Errorf("transaction_id %q: %w", xidText, err)
		}
		for _, o := range offsets {
			keys = append(keys, key{offset: o, xid: xid})
		}
	}
	if err := rows.Err(); err != nil {
		return c, err
	}
	slices.SortFunc(keys, func(a, b key) int { return cmp.Compare(a.offset, b.offset) })
	var pg Page
	seen := make(map[uint64]struct{})
	for _, k := range keys {
		if pg.Rows == 0 {
			pg.First = k.offset
		}
		pg.Last = k.offset
		pg.Rows++
		if _, ok := seen[k.xid]; !ok {
			seen[k.xid] = struct{}{}
			pg.TxIDs = append(pg.TxIDs, k.xid)
		}
		if pg.Rows == pageSize {
			c.Pages = append(c.Pages, pg)
			pg = Page{}
			clear(seen)
		}
	}
	if pg.Rows > 0 {
		c.Pages = append(c.Pages, pg)
	}
	if p.Cut == nil && len(c.Pages) > 0 {
		to, err := ParseSnapshot(cur)
		if err != nil {
			return c, err
		}
		c.To = to
	}
	return c, nil
}

// HasRows reports whether the cut from p.Snapshot to the statement's
// snapshot has a row, or name's position is no longer p (deleted, or
// moved by another instance or an operator) or no longer fits the running
// cluster (see [Origin]; the forwarder's transaction then refuses it): one
// query, index probes only, for a forwarder to ask often at little cost.
// p must have no cut in progress.
func (t Tables) HasRows(ctx context.Context, db dbx.Querier, p Position, name string) (bool, error) {
	var has bool
	err := db.QueryRow(ctx, cutSQL(t.Messages, `SELECT EXISTS (SELECT 1 FROM c) OR NOT EXISTS (
			SELECT 1 FROM `+t.Offsets+` o, pg_control_system() s WHERE o.consumer_group = $4 AND o.cut_snapshot IS NULL
			  AND o.position_snapshot::text = $1::text::pg_snapshot::text
			  AND COALESCE(o.position_system_identifier, s.system_identifier) = s.system_identifier
			  AND COALESCE(o.position_xmax, '0') <= pg_snapshot_xmax(pg_current_snapshot()))`),
		p.Snapshot.String(), nil, int64(0), name).Scan(&has)
	return has, err
}

// PageSQL is the statement of [Tables.ReadPage].
func PageSQL(messages string) string {
	return `SELECT transaction_id, "offset", uuid, payload, metadata FROM ` + messages + `
		WHERE transaction_id = ANY ($1::text[]::xid8[]) AND "offset" BETWEEN $2 AND $3`
}

// ReadPage appends to dst the rows of page, in "offset" order: one index
// range of the primary key per transaction of the page (sorted here: the
// index returns them transaction by transaction).
func (t Tables) ReadPage(ctx context.Context, db dbx.Querier, page Page, dst []Row) ([]Row, error) {
	xids := make([]string, len(page.TxIDs))
	for i, x := range page.TxIDs {
		xids[i] = strconv.FormatUint(x, 10)
	}
	rows, err := db.Query(ctx, PageSQL(t.Messages), xids, page.First, page.Last)
	if err != nil {
		return dst, err
	}
	n := len(dst)
	dst, err = appendRows(rows, dst)
	if len(page.TxIDs) > 1 {
		slices.SortFunc(dst[n:], func(a, b Row) int { return cmp.Compare(a.Offset, b.Offset) })
	}
	return dst, err
}

// ReadAll returns every row db sees in the messages table (a transaction's
// own uncommitted rows included), in "offset" (insertion) order.
func (t Tables) ReadAll(ctx context.Context, db dbx.Querier) ([]Row, error) {
	rows, err := db.Query(ctx, `SELECT transaction_id, "offset", uuid, payload, metadata FROM `+t.Messages+`
		ORDER BY "offset"`)
	if err != nil {
		return nil, err
	}
	return appendRows(rows, nil)
}

func appendRows(rows pgx.Rows, dst []Row) ([]Row, error) {
	defer rows.Close()
	for rows.Next() {
		var r Row
		if err := rows.Scan(&r.TxID, &r.Offset, &r.UUID, &r.Payload, &r.Metadata); err != nil {
			return dst, err
		}
		dst = append(dst, r)
	}
	return dst, rows.Err()
}
