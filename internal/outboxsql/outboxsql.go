// Package outboxsql holds every statement the module runs on the outbox
// tables besides watermill-sql's own (its INSERT of messages and its CREATE
// TABLEs): the forwarder's registration, position lock, batch reads and
// position update, the backlog, the deletion of forwarded rows and the read
// of a topic's messages for idemtest. It is the one place that knows the
// columns of the tables:
//
//	messages: "offset" BIGSERIAL, uuid, created_at, payload, metadata (JSON),
//	          transaction_id xid8 (the writer's pg_current_xact_id()),
//	          PRIMARY KEY (transaction_id, "offset")
//	offsets:  consumer_group PRIMARY KEY, offset_acked BIGINT,
//	          last_processed_transaction_id xid8 (watermill-sql v4's),
//	          position_snapshot, cut_snapshot pg_snapshot, cut_offset BIGINT
//	          (the forwarder's, migration 2), position_system_identifier
//	          BIGINT, position_xmax xid8 (the position's [Origin], migration 3)
//	dead:     id BIGSERIAL, the messages columns, partition_key, cause,
//	          held_behind, size, quarantined_at (migration 4, see dead.go)
//
// A forwarder's row of the offsets table is a [Position]: a snapshot, so
// that rows are forwarded in batches cut between two snapshots (PgQ's
// rule): a cut is the rows whose writing transaction is visible in the
// current snapshot and not in the previous one, in "offset" order. A
// watermill-sql subscriber's row (consumer_group = its consumer group) has
// only the watermill-sql columns; [Position] reads them too.
//
// Every statement works in all of pgx's query exec modes (the simple
// protocol included): snapshots travel as text, transaction ids as
// integers, each with an explicit cast.
package outboxsql

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Tables are one topic's messages and offsets tables, quoted and
// schema-qualified.
type Tables struct {
	Messages, Offsets string
	// Dead holds the topic's poison rows (see dead.go).
	Dead string
}

// OffsetsSuffix names a topic's offsets table, DeadSuffix its table of
// poison rows (shorter: whatever fits the first fits the second).
const (
	OffsetsSuffix = "__offsets"
	DeadSuffix    = "__dead"
)

// TopicTables returns the tables of topic in an outbox configured with
// schema and prefix (outbox.Config's Schema and TablePrefix).
func TopicTables(schema, prefix, topic string) Tables {
	return Tables{
		Messages: ident.Quote(schema, prefix+topic),
		Offsets:  ident.Quote(schema, prefix+topic+OffsetsSuffix),
		Dead:     ident.Quote(schema, prefix+topic+DeadSuffix),
	}
}

// Snapshot is a pg_snapshot: transactions below Xmin have ended, those at
// or above Xmax had not started, and Xip lists those in between still
// running. A transaction is visible in it when it committed and is below
// Xmin, or below Xmax and not in Xip (pg_visible_in_snapshot).
type Snapshot struct {
	Xmin, Xmax uint64
	Xip        []uint64
}

// Start is the snapshot in which no transaction is visible: a position
// there forwards every row.
var Start = Snapshot{Xmin: 1, Xmax: 1}

// ParseSnapshot parses pg_snapshot's text form, xmin:xmax:xip,xip,...
func ParseSnapshot(s string) (Snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return Snapshot{}, fmt.Errorf("snapshot %q: not xmin:xmax:xip", s)
	}
	var snap Snapshot
	var err error
	if snap.Xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if snap.Xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
			}
			snap.Xip = append(snap.Xip, v)
		}
	}
	if snap.Xmin == 0 || snap.Xmin > snap.Xmax {
		return Snapshot{}, fmt.Errorf("snapshot %q: xmin must be positive and at most xmax", s)
	}
	return snap, nil
}

// String is pg_snapshot's text form.
func (s Snapshot) String() string {
	var b strings.Builder
	b.WriteString(strconv.FormatUint(s.Xmin, 10))
	b.WriteByte(':')
	b.WriteString(strconv.FormatUint(s.Xmax, 10))
	b.WriteByte(':')
	for i, x := range s.Xip {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatUint(x, 10))
	}
	return b.String()
}

// Visible reports whether transaction xid, if it committed, is visible in s.
func (s Snapshot) Visible(xid uint64) bool {
	return xid < s.Xmin || xid < s.Xmax && !slices.Contains(s.Xip, xid)
}

// Intersect returns the snapshot in which a transaction is visible exactly
// when it is visible in every one of snaps (Start when snaps is empty).
func Intersect(snaps ...Snapshot) Snapshot {
	if len(snaps) == 0 {
		return Start
	}
	out := Snapshot{Xmax: snaps[0].Xmax}
	for _, s := range snaps[1:] {
		out.Xmax = min(out.Xmax, s.Xmax)
	}
	for _, s := range snaps {
		for _, x := range s.Xip {
			if x < out.Xmax && !slices.Contains(out.Xip, x) {
				out.Xip = append(out.Xip, x)
			}
		}
	}
	slices.Sort(out.Xip)
	// Below the lowest running transaction and the lowest xmax, every
	// snapshot sees every committed transaction.
	out.Xmin = out.Xmax
	if len(out.Xip) > 0 {
		out.Xmin = out.Xip[0]
	}
	return out
}

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

// Row is a row of a messages table.
type Row struct {
	// TxID is the writing transaction's id (transaction_id).
	TxID uint64
	// Offset is the row's "offset", its place in insertion order.
	Offset   int64
	UUID     string
	Payload  []byte
	Metadata []byte // a JSON object, or nil
}

// Message returns the row as a Watermill message, its metadata decoded.
func (r Row) Message() (*message.Message, error) {
	msg := message.NewMessage(r.UUID, r.Payload)
	if r.Metadata != nil {
		md, err := decodeMetadata(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("outbox row (%d, %d) metadata: %w", r.TxID, r.Offset, err)
		}
		msg.Metadata = md
	}
	return msg, nil
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

// lockSQL reads name's position and its [Origin] FOR UPDATE, so that one holder of the
// name works on the table at a time, and sets synchronous_commit to off for
// the rest of the transaction (the position may commit asynchronously: a
// lost commit resends, it never skips).
const lockSQL = `SELECT ` + positionColumns + `, ` + originColumns + `, set_config('synchronous_commit', 'off', true)
		FROM %s WHERE consumer_group = $1 FOR UPDATE`

// Tx is a transaction on one connection, begun by [Tables.BeginLock]. It
// is a dbx.Querier; end it with Commit or Rollback.
type Tx struct {
	conn *pgx.Conn
	done bool
}

// Exec runs sql in the transaction.
func (tx *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return tx.conn.Exec(ctx, sql, args...)
}

// Query runs sql in the transaction.
func (tx *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return tx.conn.Query(ctx, sql, args...)
}

// QueryRow runs sql in the transaction.
func (tx *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return tx.conn.QueryRow(ctx, sql, args...)
}

// ErrCommitRolledBack is returned by [Tx.Commit] when the server rolled
// the transaction back instead (an earlier statement had failed): pgx's
// own error, so errors.Is(err, pgx.ErrTxCommitRollback) holds.
var ErrCommitRolledBack = pgx.ErrTxCommitRollback

// Commit commits the transaction. As pgx.Tx does, it closes the connection
// when it cannot tell that the transaction ended.
func (tx *Tx) Commit(ctx context.Context) error {
	tx.done = true
	tag, err := tx.conn.Exec(ctx, "COMMIT")
	if err != nil {
		if tx.conn.PgConn().TxStatus() != 'I' {
			_ = tx.conn.Close(ctx)
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return ErrCommitRolledBack
	}
	return nil
}

// Rollback rolls the transaction back unless it was committed; when that
// fails, it closes the connection (the pool then discards it).
func (tx *Tx) Rollback(ctx context.Context) {
	if tx.done {
		return
	}
	tx.done = true
	if _, err := tx.conn.Exec(ctx, "ROLLBACK"); err != nil {
		_ = tx.conn.Close(ctx)
	}
}

// BeginLock begins a transaction on conn and locks name's position in it
// (lockSQL; [ErrNoPosition] when name has no position, see
// [Tables.Register]), and checks that the position is from the running
// cluster ([*ForeignError] when not), in one round trip (BEGIN, the lock
// and the check are sent as one batch). On error the transaction is rolled
// back.
func (t Tables) BeginLock(ctx context.Context, conn *pgx.Conn, name string, limits Limits) (*Tx, Position, error) {
	tx := &Tx{conn: conn}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	if limits.Idle > 0 || limits.Lock > 0 {
		b.Queue(limitsSQL, ms(limits.Idle), ms(limits.Lock))
	}
	b.Queue(fmt.Sprintf(lockSQL, t.Offsets), name)
	// The running cluster's origin, in a statement of its own: its
	// snapshot is taken once the lock is held, so it sees the version of
	// the row the lock returned (which may have committed after the lock
	// statement's snapshot).
	b.Queue(`SELECT ` + originHere)
	br := conn.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil && (limits.Idle > 0 || limits.Lock > 0) {
		_, err = br.Exec()
	}
	var (
		p               Position
		stored, current originScan
	)
	if err == nil {
		var discard string
		p, err = scanPosition(br.QueryRow(), &stored.system, &stored.xmax, &discard)
	}
	if err == nil {
		err = br.QueryRow().Scan(&current.system, &current.xmax)
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err == nil {
		err = checkOrigin(name, stored, current)
	}
	if err != nil {
		tx.Rollback(context.WithoutCancel(ctx))
		if errors.Is(err, pgx.ErrNoRows) {
			err = ErrNoPosition
		}
		return nil, Position{}, err
	}
	return tx, p, nil
}

// Ack moves name's position, locked by [Tables.BeginLock] in this transaction,
// to p, and watermill-sql's columns to the (transaction_id, offset)
// position p has certainly passed. It returns [ErrNoPosition] when name has
// no position.
func (t Tables) Ack(ctx context.Context, db dbx.Querier, name string, p Position) error {
	sql, args := t.ackSQL(name, p)
	tag, err := db.Exec(ctx, sql, args...)
	if err == nil && tag.RowsAffected() == 0 {
		err = ErrNoPosition
	}
	return err
}

// ackSQL is the statement of [Tables.Ack] and its arguments.
func (t Tables) ackSQL(name string, p Position) (string, []any) {
	var cut *string
	var cutOffset *int64
	if p.Cut != nil {
		s := p.Cut.String()
		cut, cutOffset = &s, &p.CutOffset
	}
	wsqlTx, wsqlOff := watermillSQLColumns(p)
	return `UPDATE ` + t.Offsets + ` SET
			offset_acked = $2,
			last_processed_transaction_id = $3::text::xid8,
			position_snapshot = $4::text::pg_snapshot,
			cut_snapshot = $5::text::pg_snapshot,
			cut_offset = $6,
			(` + originSet + `) = (SELECT ` + originValues + `)
		WHERE consumer_group = $1`,
		[]any{name, wsqlOff, strconv.FormatUint(wsqlTx, 10), p.Snapshot.String(), cut, cutOffset}
}

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
