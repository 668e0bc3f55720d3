package leasesql

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
)

// State is what a take found for one event.
type State int

const (
	// Owned: the caller holds the lease (new, or taken over from an
	// expired one); run the handler, then complete it.
	Owned State = iota + 1
	// Done: the event has a claim already (a duplicate); no lease is left
	// behind.
	Done
	// Busy: another delivery holds a live lease; do not run the handler.
	// [Take.Remaining] says for how long at most.
	Busy
)

func (s State) String() string {
	switch s {
	case Owned:
		return "owned"
	case Done:
		return "done"
	case Busy:
		return "busy"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Request asks for the lease of one event with the caller's fencing token
// (a fresh random UUID per delivery).
type Request struct {
	EventID uuid.UUID
	Token   uuid.UUID
}

// Take is the outcome of one [Request].
type Take struct {
	EventID uuid.UUID
	State   State
	// TakenOver: the lease was taken from an expired one (its owner
	// crashed, or called for longer than the lease and failed to renew it).
	TakenOver bool
	// Attempts counts the leases taken on the event so far, this one
	// included (Owned by [Protocol.Take]; the fast path counts only the
	// leases it writes).
	Attempts int
	// Remaining is how long the other delivery's lease lives at most
	// (Busy); 0 when that is unknown: the lease vanished meanwhile, or a
	// fast-path transaction holds the event (poll).
	Remaining time.Duration
}

// Result is what a completion found for one token.
type Result int

const (
	// Completed: the lease was the caller's; it is gone and the claim is
	// inserted, both in the caller's transaction.
	Completed Result = iota + 1
	// Lost: the token no longer holds the lease (it expired and was taken
	// over, or an operator released it). Write nothing.
	Lost
	// Duplicate: the token held the lease, but the event has a claim
	// already (another mode's delivery claimed it). Write nothing.
	Duplicate
)

// Protocol runs the lease statements of one table for one consumer group.
type Protocol struct {
	group string
	keyNS []byte // schema, table and group: the advisory lock keys' namespace
	sql   statements
}

// New returns the protocol of schema.table's lease table (table_lease) for
// group.
func New(schema, table, group string) *Protocol {
	ns := []byte(schema + "\x00" + table + "\x00" + group + "\x00")
	return &Protocol{group: group, keyNS: ns, sql: newStatements(schema, table)}
}

// statements holds the lease statements of one table.
type statements struct {
	take, doneAfterTake, state, complete, completeAll, renew, release     string
	fastLock, fastState, fastTakeOver, fastClaim, fastClaimAll, fastLease string
}

func newStatements(schema, table string) statements {
	t := ident.Quote(schema, table)
	l := ident.Quote(schema, table+"_lease")
	st := statements{
		// A new lease for every id without a claim whose advisory lock ($6,
		// one key per id) is free, or a takeover of an expired one; a live
		// lease of another delivery is left alone (no row returned), and so
		// is an event a fast-path transaction holds (its lock is taken).
		// Sorted ids: two batches lock rows in the same order. The NOT
		// EXISTS filter skips plain duplicates without writing; it reads the
		// statement's snapshot, so doneAfterTake repeats the check after the
		// locks are held.
		take: "INSERT INTO " + l + " AS l (event_id, consumer_group, token, expires_at, owner) " +
			"SELECT u.id, $3, u.tok, now() + $4 * interval '1 microsecond', $5 " +
			"FROM unnest($1::uuid[], $2::uuid[], $6::int8[]) AS u(id, tok, k) " +
			"WHERE NOT EXISTS (SELECT 1 FROM " + t + " p WHERE p.event_id = u.id AND p.consumer_group = $3) " +
			"AND pg_try_advisory_xact_lock(u.k) " +
			"ORDER BY u.id " +
			"ON CONFLICT (event_id, consumer_group) DO UPDATE SET token = EXCLUDED.token, " +
			"expires_at = EXCLUDED.expires_at, owner = EXCLUDED.owner, taken_at = now(), attempts = l.attempts + 1 " +
			"WHERE l.expires_at <= now() " +
			"RETURNING l.event_id, l.attempts > 1 AS taken_over, l.attempts",
		// A claim committed while take waited for a lease's lock is seen by
		// this later statement (READ COMMITTED: a snapshot per statement):
		// the lease just taken on a done event is removed again. The ids
		// ($3) reach the lease table through its primary key: token alone
		// has no index, and the table churns (a seq scan of its live and
		// dead rows on every take).
		doneAfterTake: "DELETE FROM " + l + " l USING " + t + " p " +
			"WHERE l.event_id = ANY($3::uuid[]) AND l.consumer_group = $2 AND l.token = ANY($1::uuid[]) " +
			"AND p.event_id = l.event_id AND p.consumer_group = l.consumer_group RETURNING l.event_id",
		// The state of every requested id that this take does not own (its
		// own leases come back from take, less doneAfterTake's): a claim
		// (done), or another delivery's lease and how long it lives (busy).
		// The claim is a join, not an EXISTS in the select list: PostgreSQL
		// may run that as a hashed subplan, a seq scan of the whole claim
		// table on every take while the table is small enough to look
		// cheap (tens of thousands of rows: milliseconds per take).
		state: "SELECT u.id, p.event_id IS NOT NULL, l.token, " +
			"(extract(epoch FROM greatest(l.expires_at - now(), interval '0')) * 1000000)::bigint " +
			"FROM unnest($1::uuid[], $3::uuid[]) AS u(id, tok) " +
			"LEFT JOIN " + l + " l ON l.event_id = u.id AND l.consumer_group = $2 " +
			"LEFT JOIN " + t + " p ON p.event_id = u.id AND p.consumer_group = $2 " +
			"WHERE l.token IS DISTINCT FROM u.tok",
		// The completion: the token check (the lease row is deleted, and
		// locked until COMMIT, so no takeover can slip in) and the claim, in
		// one statement.
		complete: "WITH del AS (DELETE FROM " + l + " WHERE consumer_group = $2 AND (event_id, token) IN " +
			"(SELECT * FROM unnest($1::uuid[], $3::uuid[])) RETURNING event_id, token), " +
			"ins AS (INSERT INTO " + t + " (event_id, consumer_group) SELECT event_id, $2 FROM del ORDER BY event_id " +
			"ON CONFLICT (event_id, consumer_group) DO NOTHING RETURNING event_id) " +
			"SELECT del.token, ins.event_id IS NOT NULL FROM del LEFT JOIN ins ON ins.event_id = del.event_id",
		// completeAll is complete for a pipeline whose next statements
		// (the handlers' writes) must not commit unless every token held
		// its lease and claimed its event: it returns no row per token, and
		// fails with division_by_zero (SQLSTATE 22012, see mustAll) unless
		// all of them did. Plain SQL has no RAISE; a division by an
		// aggregate's zero is evaluated at run time only, in the ELSE
		// branch.
		completeAll: "WITH del AS (DELETE FROM " + l + " WHERE consumer_group = $2 AND (event_id, token) IN " +
			"(SELECT * FROM unnest($1::uuid[], $3::uuid[])) RETURNING event_id), " +
			"ins AS (INSERT INTO " + t + " (event_id, consumer_group) SELECT event_id, $2 FROM del ORDER BY event_id " +
			"ON CONFLICT (event_id, consumer_group) DO NOTHING RETURNING event_id) " +
			"SELECT " + mustAll("(SELECT count(*) FROM ins)", "cardinality($1::uuid[])"),
		renew: "UPDATE " + l + " SET expires_at = now() + $4 * interval '1 microsecond' " +
			"WHERE event_id = $1 AND consumer_group = $2 AND token = $3",
		release: "DELETE FROM " + l + " WHERE event_id = $1 AND consumer_group = $2 AND token = $3",
	}
	st.fastLock, st.fastState, st.fastTakeOver, st.fastClaim, st.fastLease = fastStatements(t, l)
	// fastClaim for a pipeline: every finished event claimed, or
	// division_by_zero (see completeAll).
	st.fastClaimAll = "WITH ins AS (" + st.fastClaim + ") SELECT " + mustAll("(SELECT count(*) FROM ins)", "cardinality($1::uuid[])")
	return st
}

// mustAll is a select list that is 0 when got equals want (two bigint
// expressions) and otherwise fails the statement with division_by_zero
// ([ErrNotAllHeld]).
func mustAll(got, want string) string {
	return "CASE WHEN " + got + " = " + want + " THEN 0 ELSE 1 / (" + got + " * 0) END"
}

// ErrNotAllHeld is a strict completion's failure ([Protocol.QueueCompleteAll],
// [Protocol.QueueFinishAll]): a token no longer held its lease, or an
// event had a claim already. The statement failed, so nothing of its
// transaction commits; which member it was, a completion one by one
// ([Protocol.BeginComplete], [Protocol.Open]) tells.
var ErrNotAllHeld = errors.New("not every lease of the batch is held")

// readAll reads a strict statement's result: nil, [ErrNotAllHeld] or the
// statement's error. The SQLSTATE is the statement's own: its position in
// the pipeline says it is no handler's.
func readAll(br pgx.BatchResults) error {
	_, err := br.Exec()
	if pgerr.Has(err, pgerrcode.DivisionByZero) {
		return ErrNotAllHeld
	}
	return err
}

// fastStatements returns the fast path's statements for the claim table t
// and the lease table l (both quoted).
func fastStatements(t, l string) (lock, state, takeOver, claim, lease string) {
	// The advisory locks: the keys another transaction holds come back
	// (their events are busy).
	lock = "SELECT k FROM unnest($1::int8[]) AS k WHERE NOT pg_try_advisory_xact_lock(k)"
	// The state read, under the advisory locks: a claim (done), a lease
	// (live: busy, how long it lives; expired: to take over, its attempts
	// so far). Joins, as the take's state read.
	state = "SELECT u.id, p.event_id IS NOT NULL, l.event_id IS NOT NULL, coalesce(l.expires_at > now(), false), " +
		"coalesce((extract(epoch FROM greatest(l.expires_at - now(), interval '0')) * 1000000)::bigint, 0), coalesce(l.attempts, 0) " +
		"FROM unnest($1::uuid[]) AS u(id) " +
		"LEFT JOIN " + l + " l ON l.event_id = u.id AND l.consumer_group = $2 " +
		"LEFT JOIN " + t + " p ON p.event_id = u.id AND p.consumer_group = $2"
	// The expired leases taken over and completed: gone with the claim
	// (their owners' completions then find them lost).
	takeOver = "DELETE FROM " + l + " WHERE event_id = ANY($1::uuid[]) AND consumer_group = $2"
	// The claims, sorted ids: the events claimed for the first time come
	// back.
	claim = "INSERT INTO " + t + " (event_id, consumer_group) SELECT id, $2 FROM unnest($1::uuid[]) AS u(id) ORDER BY id " +
		"ON CONFLICT (event_id, consumer_group) DO NOTHING RETURNING event_id"
	// The leases of the handlers still running at the deadline; an expired
	// lease read at the open is replaced (the advisory locks kept every
	// other take away since).
	lease = "INSERT INTO " + l + " AS l (event_id, consumer_group, token, expires_at, owner) " +
		"SELECT u.id, $3, u.tok, now() + $4 * interval '1 microsecond', $5 " +
		"FROM unnest($1::uuid[], $2::uuid[]) AS u(id, tok) ORDER BY u.id " +
		"ON CONFLICT (event_id, consumer_group) DO UPDATE SET token = EXCLUDED.token, " +
		"expires_at = EXCLUDED.expires_at, owner = EXCLUDED.owner, taken_at = now(), attempts = l.attempts + 1"
	return lock, state, takeOver, claim, lease
}

// LockKey is the advisory lock key of id's lease for the protocol's table
// and group: 64 bits of FNV-1a. Two events that share a key (or an
// application's own advisory lock of the same number) only wait for each
// other; nothing else depends on the key.
func (p *Protocol) LockKey(id uuid.UUID) int64 {
	h := fnv.New64a()
	_, _ = h.Write(p.keyNS)
	_, _ = h.Write(id[:])
	return int64(binary.BigEndian.Uint64(h.Sum(nil)))
}

// lockKeys returns the keys of ids, in their order.
func (p *Protocol) lockKeys(ids []uuid.UUID) []int64 {
	keys := make([]int64, len(ids))
	for i, id := range ids {
		keys[i] = p.LockKey(id)
	}
	return keys
}

// Take takes the leases of reqs for d, on the database's clock, in one
// round trip and one implicit transaction of db (which must not be inside
// a transaction). Each id gets one [Take], in the order of reqs: owned
// (new, or taken over from an expired lease), done (a claim exists; no
// lease is left) or busy (another delivery's live lease). owner is
// recorded for operators (say, host and pid).
func (p *Protocol) Take(ctx context.Context, db dbx.BatchSender, reqs []Request, d time.Duration, owner string) ([]Take, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	if d <= 0 {
		return nil, errors.New("take leases: the duration must be positive")
	}
	sorted := dedupSorted(reqs)
	ids := make([]uuid.UUID, len(sorted))
	toks := make([]uuid.UUID, len(sorted))
	for i, r := range sorted {
		ids[i], toks[i] = r.EventID, r.Token
	}
	b := &pgx.Batch{}
	// The take commits without waiting for its WAL flush: a server crash
	// may forget the last leases taken, and their owners then find their
	// tokens gone at renewal or completion (nothing written) or a new
	// delivery takes a fresh lease. Only the completion, a synchronous
	// commit, decides anything durable. This spares each batch an fsync.
	b.Queue("SELECT set_config('synchronous_commit', 'off', true)")
	pids, ptoks := dbx.UUIDs(ids), dbx.UUIDs(toks)
	b.Queue(p.sql.take, pids, ptoks, p.group, d.Microseconds(), owner, p.lockKeys(ids))
	b.Queue(p.sql.doneAfterTake, ptoks, p.group, pids)
	b.Queue(p.sql.state, pids, p.group, ptoks)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("take leases: %w", err)
	}
	byID, err := readTakes(br, len(ids))
	if err != nil {
		return nil, err
	}
	return inOrder(reqs, sorted, byID)
}

// dedupSorted returns reqs sorted by event id, the first request of each
// id kept.
func dedupSorted(reqs []Request) []Request {
	sorted := slices.Clone(reqs)
	slices.SortStableFunc(sorted, func(a, b Request) int { return bytes.Compare(a.EventID[:], b.EventID[:]) })
	return slices.CompactFunc(sorted, func(a, b Request) bool { return a.EventID == b.EventID })
}

// takenLease is a lease the take statement took: over when it took it from
// an expired owner, attempts its count of takes.
type takenLease struct {
	over     bool
	attempts int
}

// readTakes reads the take batch's three results (the leases taken, the
// events found done after the take, the state of every id) into each
// event's Take, and closes the batch.
func readTakes(br pgx.BatchResults, n int) (map[uuid.UUID]Take, error) {
	owned := map[uuid.UUID]takenLease{}
	rows, _ := br.Query()
	var (
		id     uuid.UUID
		t      takenLease
		done   bool
		tok    *[16]byte
		remain *int64
	)
	if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id), &t.over, &t.attempts}, func() error {
		owned[id] = t
		return nil
	}); err != nil {
		return nil, fmt.Errorf("take leases: %w", err)
	}
	rows, _ = br.Query()
	if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id)}, func() error {
		delete(owned, id)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("take leases: recheck claims: %w", err)
	}
	byID := make(map[uuid.UUID]Take, n)
	rows, _ = br.Query()
	if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id), &done, &tok, &remain}, func() error {
		lt := Take{EventID: id}
		switch o, mine := owned[id]; {
		case mine:
			lt.State, lt.TakenOver, lt.Attempts = Owned, o.over, o.attempts
		case done:
			lt.State = Done
		default:
			lt.State = Busy
			if tok != nil && remain != nil {
				lt.Remaining = time.Duration(*remain) * time.Microsecond
			}
		}
		byID[id] = lt
		return nil
	}); err != nil {
		return nil, fmt.Errorf("take leases: read states: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("take leases: %w", err)
	}
	for id, o := range owned {
		if _, read := byID[id]; !read {
			byID[id] = Take{EventID: id, State: Owned, TakenOver: o.over, Attempts: o.attempts}
		}
	}
	return byID, nil
}

// inOrder answers reqs in their order from byID; sorted holds the requests
// deduplicated by event, the first token of each id.
func inOrder(reqs, sorted []Request, byID map[uuid.UUID]Take) ([]Take, error) {
	tokenOf := make(map[uuid.UUID]uuid.UUID, len(sorted))
	for _, r := range sorted {
		tokenOf[r.EventID] = r.Token
	}
	out := make([]Take, len(reqs))
	for i, r := range reqs {
		lt, ok := byID[r.EventID]
		if !ok {
			return nil, fmt.Errorf("take leases: no state read for event %s", r.EventID)
		}
		if lt.State == Owned && tokenOf[r.EventID] != r.Token {
			// The same id twice in reqs: only the first token took it.
			lt = Take{EventID: r.EventID, State: Busy}
		}
		out[i] = lt
	}
	return out, nil
}

// Complete checks the tokens and claims their events in tx: the leases
// still held by their tokens are deleted (and stay locked until tx ends,
// so no takeover slips in) and their claims inserted, in one statement.
// The result, per token in the order given, tells whether to write the
// handler's effects in tx ([Completed]) or to write nothing ([Lost],
// [Duplicate]). Commit tx with the effects; roll it back and the leases
// stand again, untouched.
func (p *Protocol) Complete(ctx context.Context, tx dbx.Querier, eventIDs, tokens []uuid.UUID) ([]Result, error) {
	if len(eventIDs) != len(tokens) {
		return nil, errors.New("complete leases: one token per event id")
	}
	if len(eventIDs) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, p.sql.complete, dbx.UUIDs(eventIDs), p.group, dbx.UUIDs(tokens))
	if err != nil {
		return nil, fmt.Errorf("complete leases: %w", err)
	}
	return readComplete(rows, tokens)
}

// readComplete reads the complete statement's rows into one result per
// token.
func readComplete(rows pgx.Rows, tokens []uuid.UUID) ([]Result, error) {
	got := map[uuid.UUID]bool{}
	var (
		tok     uuid.UUID
		claimed bool
	)
	if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&tok), &claimed}, func() error {
		got[tok] = claimed
		return nil
	}); err != nil {
		return nil, fmt.Errorf("complete leases: %w", err)
	}
	out := make([]Result, len(tokens))
	for i, t := range tokens {
		switch claimed, held := got[t]; {
		case !held:
			out[i] = Lost
		case claimed:
			out[i] = Completed
		default:
			out[i] = Duplicate
		}
	}
	return out, nil
}

// QueueCompleteAll queues in b, for a pipeline in one transaction (a batch
// sent on a pool, its implicit transaction), the completion of every
// token: their leases deleted and their events claimed, or the statement
// fails. Queue the handlers' writes after it, and read its result with
// [ReadCompleteAll] first: [ErrNotAllHeld] means a token was lost or an
// event claimed already, and the pipeline's transaction must not commit
// (a batch's implicit transaction does not: it failed).
func (p *Protocol) QueueCompleteAll(b *pgx.Batch, eventIDs, tokens []uuid.UUID) {
	b.Queue(p.sql.completeAll, dbx.UUIDs(eventIDs), p.group, dbx.UUIDs(tokens))
}

// ReadCompleteAll reads the result of [Protocol.QueueCompleteAll]'s
// statement: nil when every token completed, [ErrNotAllHeld], or the
// statement's failure.
func ReadCompleteAll(br pgx.BatchResults) error {
	if err := readAll(br); err != nil {
		return fmt.Errorf("complete leases: %w", err)
	}
	return nil
}

// BeginComplete begins a transaction on db and runs [Protocol.Complete] in
// it: with a pool or a conn, BEGIN and the statement travel as one
// pipelined round trip. A non-nil tx must be committed or rolled back by
// the caller, also with an error.
func (p *Protocol) BeginComplete(ctx context.Context, db dbx.Beginner, eventIDs, tokens []uuid.UUID) (tx pgx.Tx, res []Result, err error) {
	if len(eventIDs) != len(tokens) {
		return nil, nil, errors.New("complete leases: one token per event id")
	}
	tx, err = dbx.BeginPipelined(ctx, db, pgx.TxOptions{}, func(b *pgx.Batch) {
		b.Queue(p.sql.complete, dbx.UUIDs(eventIDs), p.group, dbx.UUIDs(tokens))
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		res, err = readComplete(rows, tokens)
		return err
	}, func(tx pgx.Tx) (err error) {
		res, err = p.Complete(ctx, tx, eventIDs, tokens)
		return err
	})
	if err != nil {
		return tx, nil, fmt.Errorf("complete leases: %w", err)
	}
	return tx, res, nil
}

// Renew extends the lease of eventID held by token to d from now on the
// database's clock. It reports false when token no longer holds it.
func (p *Protocol) Renew(ctx context.Context, db dbx.Querier, eventID, token uuid.UUID, d time.Duration) (bool, error) {
	tag, err := db.Exec(ctx, p.sql.renew, dbx.UUID(eventID), p.group, dbx.UUID(token), d.Microseconds())
	if err != nil {
		return false, fmt.Errorf("renew lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Release deletes the lease of eventID if token still holds it, so the
// next delivery takes a new one at once (after a handler error). It
// reports whether it did.
func (p *Protocol) Release(ctx context.Context, db dbx.Querier, eventID, token uuid.UUID) (bool, error) {
	tag, err := db.Exec(ctx, p.sql.release, dbx.UUID(eventID), p.group, dbx.UUID(token))
	if err != nil {
		return false, fmt.Errorf("release lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}
