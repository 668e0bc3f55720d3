package outboxsql

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// cutEndSetting is a transaction-local setting that carries a new cut's end
// snapshot from the statement that takes it to the statement that reads
// the cut's first page, sent behind it in the same round trip.
const cutEndSetting = "idem_outbox.cut_end"

// cutKeysSQL is [CutSQL] that also stores the end snapshot in
// cutEndSetting for the rest of the transaction.
func cutKeysSQL(messages string) string {
	return cutSQLFrom(messages,
		`SELECT s.snap, set_config('`+cutEndSetting+`', s.snap::text, true) AS stored
		FROM (SELECT COALESCE($2::text::pg_snapshot, pg_current_snapshot()) AS snap) s`,
		`SELECT c.transaction_id::text, array_agg(c."offset"), (SELECT snap::text FROM e) FROM c GROUP BY c.transaction_id`)
}

// firstPageSQL reads the first $4 rows, in "offset" order, of the cut that
// cutKeysSQL read earlier in the transaction (its end: $2, or the snapshot
// stored in cutEndSetting; none stored: no row).
func firstPageSQL(messages string) string {
	return cutSQLFrom(messages,
		`SELECT COALESCE($2::text::pg_snapshot, NULLIF(current_setting('`+cutEndSetting+`', true), '')::pg_snapshot) AS snap`,
		`SELECT m.transaction_id, m."offset", m.uuid, m.payload, m.metadata
		FROM (SELECT c.transaction_id, c."offset" FROM c ORDER BY c."offset" LIMIT $4) k
		JOIN `+messages+` m ON m.transaction_id = k.transaction_id AND m."offset" = k."offset"
		ORDER BY k."offset"`)
}

// ReadCutDeadKeysAndFirstPage is [Tables.ReadCut], then [Tables.DeadKeys],
// then the rows of the cut's first page as [Tables.ReadPage] would read
// them, in one round trip on tx: the three statements go as one batch. The
// rows are nil when the cut has no page, or when they are not exactly its
// first page's (rows deleted or moved between the statements): read it
// then with ReadPage.
func (t Tables) ReadCutDeadKeysAndFirstPage(ctx context.Context, tx *Tx, p Position, pageSize int) (Cut, map[string]int64, []Row, error) {
	return t.readCut(ctx, tx, nil, p, pageSize, true)
}

// ReadCutAndDeadKeys is ReadCutDeadKeysAndFirstPage without the first
// page.
func (t Tables) ReadCutAndDeadKeys(ctx context.Context, tx *Tx, p Position, pageSize int) (Cut, map[string]int64, error) {
	c, dead, _, err := t.readCut(ctx, tx, nil, p, pageSize, false)
	return c, dead, err
}

// AckAndReadCut is [Tables.Ack] of name's position to p, then
// ReadCutDeadKeysAndFirstPage of the cut that continues p, in one round
// trip on tx.
func (t Tables) AckAndReadCut(ctx context.Context, tx *Tx, name string, p Position, pageSize int) (Cut, map[string]int64, []Row, error) {
	sql, args := t.ackSQL(name, p)
	return t.readCut(ctx, tx, &pgx.QueuedQuery{SQL: sql, Arguments: args}, p, pageSize, true)
}

// readCut sends ack (when not nil: the position update, which must change
// one row), then the cut's keys, the dead keys and, with withFirst, the
// first page.
func (t Tables) readCut(ctx context.Context, tx *Tx, ack *pgx.QueuedQuery, p Position, pageSize int, withFirst bool) (Cut, map[string]int64, []Row, error) {
	c := Cut{From: p.Snapshot}
	var to *string
	if p.Cut != nil {
		s := p.Cut.String()
		to, c.To, c.After = &s, *p.Cut, p.CutOffset
	}
	b := &pgx.Batch{}
	if ack != nil {
		b.Queue(ack.SQL, ack.Arguments...)
	}
	b.Queue(cutKeysSQL(t.Messages), p.Snapshot.String(), to, c.After)
	b.Queue(deadKeysSQL(t.Dead))
	if withFirst {
		b.Queue(firstPageSQL(t.Messages), p.Snapshot.String(), to, c.After, pageSize)
	}
	br := tx.conn.SendBatch(ctx, b)
	var err error
	if ack != nil {
		var tag pgconn.CommandTag
		if tag, err = br.Exec(); err == nil && tag.RowsAffected() == 0 {
			err = ErrNoPosition
		}
	}
	var rows pgx.Rows
	if err == nil {
		if rows, err = br.Query(); err == nil {
			c, err = t.scanCut(c, p, rows, pageSize)
		}
	}
	var dead map[string]int64
	if err == nil {
		if rows, err = br.Query(); err == nil {
			dead, err = scanDeadKeys(rows)
		}
	}
	var first []Row
	if err == nil && withFirst {
		if rows, err = br.Query(); err == nil {
			first, err = appendRows(rows, make([]Row, 0, min(pageSize, 64)))
		}
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return c, nil, nil, err
	}
	if len(c.Pages) == 0 || !isPage(first, c.Pages[0]) {
		first = nil
	}
	return c, dead, first, nil
}

// isPage reports whether rows are exactly page's.
func isPage(rows []Row, page Page) bool {
	return len(rows) == page.Rows && len(rows) > 0 &&
		rows[0].Offset == page.First && rows[len(rows)-1].Offset == page.Last
}
