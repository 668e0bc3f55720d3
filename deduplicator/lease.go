package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// BatchSender runs a pgx.Batch: a *pgxpool.Pool or a *pgx.Conn. Outside an
// explicit transaction, the statements of one batch run in one implicit
// transaction (one Sync): they commit together or not at all.
type BatchSender = dbx.BatchSender

// LeaseState is what [Deduplicator.TakeLeases] found for one event.
type LeaseState int

const (
	// LeaseOwned: the caller holds the lease (new, or taken over from an
	// expired one); run the handler, then complete it.
	LeaseOwned LeaseState = iota + 1
	// LeaseDone: the event has a claim already (a duplicate); no lease is
	// left behind.
	LeaseDone
	// LeaseBusy: another delivery holds a live lease; do not run the
	// handler. [LeaseTake.Remaining] says for how long at most.
	LeaseBusy
)

func (s LeaseState) String() string {
	switch s {
	case LeaseOwned:
		return "owned"
	case LeaseDone:
		return "done"
	case LeaseBusy:
		return "busy"
	}
	return fmt.Sprintf("LeaseState(%d)", int(s))
}

// LeaseRequest asks for the lease of one event with the caller's fencing
// token (a fresh random UUID per delivery).
type LeaseRequest struct {
	EventID uuid.UUID
	Token   uuid.UUID
}

// LeaseTake is the outcome of one [LeaseRequest].
type LeaseTake struct {
	EventID uuid.UUID
	State   LeaseState
	// TakenOver: the lease was taken from an expired one (its owner crashed,
	// or called for longer than the lease and failed to renew it).
	TakenOver bool
	// Attempts counts the leases taken on the event so far, this one
	// included (LeaseOwned).
	Attempts int
	// Remaining is how long the other delivery's lease lives at most
	// (LeaseBusy); 0 when it vanished meanwhile (take again at once).
	Remaining time.Duration
}

// Lease is one row of the lease table, as [Deduplicator.Leases] lists it.
type Lease struct {
	EventID       uuid.UUID `json:"event_id"`
	ConsumerGroup string    `json:"consumer_group"`
	Token         uuid.UUID `json:"token"`
	TakenAt       time.Time `json:"taken_at"`
	ExpiresAt     time.Time `json:"expires_at"`
	Attempts      int       `json:"attempts"`
	Owner         string    `json:"owner"`
	// Expired: the lease is past expires_at on the database's clock; the
	// next delivery of its event takes it over.
	Expired bool `json:"expired"`
}

// CompleteResult is what [Deduplicator.CompleteLeases] found for one token.
type CompleteResult int

const (
	// Completed: the lease was the caller's; it is gone and the claim is
	// inserted, both in the caller's transaction.
	Completed CompleteResult = iota + 1
	// CompleteLost: the token no longer holds the lease (it expired and was
	// taken over, or an operator released it). Write nothing.
	CompleteLost
	// CompleteDuplicate: the token held the lease, but the event has a claim
	// already (another mode's delivery claimed it). Write nothing.
	CompleteDuplicate
)

// leaseSQL holds the lease statements of one table.
type leaseSQL struct {
	take, doneAfterTake, state, complete, renew, release, list, forceRelease, sweep, sweepCount string
}

func newLeaseSQL(schema, table string) leaseSQL {
	t := ident.Quote(schema, table)
	l := ident.Quote(schema, table+"_lease")
	return leaseSQL{
		// A new lease for every id without a claim, or a takeover of an
		// expired one; a live lease of another delivery is left alone (no row
		// returned). Sorted ids: two batches lock in the same order. The
		// NOT EXISTS filter skips plain duplicates without writing; it reads
		// the statement's snapshot, so doneAfterTake repeats the check after
		// the locks are held.
		take: "INSERT INTO " + l + " AS l (event_id, consumer_group, token, expires_at, owner) " +
			"SELECT u.id, $3, u.tok, now() + $4 * interval '1 microsecond', $5 " +
			"FROM unnest($1::uuid[], $2::uuid[]) AS u(id, tok) " +
			"WHERE NOT EXISTS (SELECT 1 FROM " + t + " p WHERE p.event_id = u.id AND p.consumer_group = $3) " +
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
		renew: "UPDATE " + l + " SET expires_at = now() + $4 * interval '1 microsecond' " +
			"WHERE event_id = $1 AND consumer_group = $2 AND token = $3",
		release: "DELETE FROM " + l + " WHERE event_id = $1 AND consumer_group = $2 AND token = $3",
		list: "SELECT event_id, consumer_group, token, taken_at, expires_at, attempts, owner, expires_at <= now() " +
			"FROM " + l + " WHERE ($1 = '' OR consumer_group = $1) AND ($2 = 'all' OR ($2 = 'live') = (expires_at > now())) " +
			"ORDER BY taken_at LIMIT $3",
		forceRelease: "DELETE FROM " + l + " WHERE event_id = $1 AND consumer_group = $2",
		sweep:        "DELETE FROM " + l + " WHERE expires_at < $1",
		sweepCount:   "SELECT count(*) FROM " + l + " WHERE expires_at < $1",
	}
}

// TakeLeases takes the leases of reqs for the consumer group for d, on the
// database's clock, in one round trip and one implicit transaction of db
// (which must not be inside a transaction). Each id gets one [LeaseTake], in
// the order of reqs: owned (new, or taken over from an expired lease), done
// (a claim exists; no lease is left) or busy (another delivery's live
// lease). owner is recorded for operators (say, host and pid).
func (d *Deduplicator) TakeLeases(ctx context.Context, db BatchSender, reqs []LeaseRequest, d0 time.Duration, owner string) ([]LeaseTake, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	if d0 <= 0 {
		return nil, errors.New("take leases: the duration must be positive")
	}
	sorted := slices.Clone(reqs)
	slices.SortFunc(sorted, func(a, b LeaseRequest) int { return compareUUID(a.EventID, b.EventID) })
	sorted = slices.CompactFunc(sorted, func(a, b LeaseRequest) bool { return a.EventID == b.EventID })
	ids := make([]uuid.UUID, len(sorted))
	toks := make([]uuid.UUID, len(sorted))
	for i, r := range sorted {
		ids[i], toks[i] = r.EventID, r.Token
	}
	g := d.cfg.ConsumerGroup
	b := &pgx.Batch{}
	// The take commits without waiting for its WAL flush: a server crash
	// may forget the last leases taken, and their owners then find their
	// tokens gone at renewal or completion (nothing written) or a new
	// delivery takes a fresh lease. Only the completion, a synchronous
	// commit, decides anything durable. This spares each batch an fsync.
	b.Queue("SELECT set_config('synchronous_commit', 'off', true)")
	pids, ptoks := dbx.UUIDs(ids), dbx.UUIDs(toks)
	b.Queue(d.lease.take, pids, ptoks, g, d0.Microseconds(), owner)
	b.Queue(d.lease.doneAfterTake, ptoks, g, pids)
	b.Queue(d.lease.state, pids, g, ptoks)
	br := db.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("take leases: %w", err)
	}
	byID, err := readTakes(br, len(ids))
	if err != nil {
		return nil, err
	}
	return takesInOrder(reqs, sorted, byID)
}

// takenLease is a lease the take statement took: over when it took it from
// an expired owner, attempts its count of takes.
type takenLease struct {
	over     bool
	attempts int
}

// readTakes reads the take batch's three results (the leases taken, the
// events found done after the take, the state of every id) into each
// event's LeaseTake, and closes the batch.
func readTakes(br pgx.BatchResults, n int) (map[uuid.UUID]LeaseTake, error) {
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
	byID := make(map[uuid.UUID]LeaseTake, n)
	rows, _ = br.Query()
	if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id), &done, &tok, &remain}, func() error {
		lt := LeaseTake{EventID: id}
		switch o, mine := owned[id]; {
		case mine:
			lt.State, lt.TakenOver, lt.Attempts = LeaseOwned, o.over, o.attempts
		case done:
			lt.State = LeaseDone
		default:
			lt.State = LeaseBusy
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
			byID[id] = LeaseTake{EventID: id, State: LeaseOwned, TakenOver: o.over, Attempts: o.attempts}
		}
	}
	return byID, nil
}

// takesInOrder answers reqs in their order from byID; sorted holds the
// requests deduplicated by event, the first token of each id.
func takesInOrder(reqs, sorted []LeaseRequest, byID map[uuid.UUID]LeaseTake) ([]LeaseTake, error) {
	tokenOf := make(map[uuid.UUID]uuid.UUID, len(sorted))
	for _, r := range sorted {
		tokenOf[r.EventID] = r.Token
	}
	out := make([]LeaseTake, len(reqs))
	for i, r := range reqs {
		lt, ok := byID[r.EventID]
		if !ok {
			return nil, fmt.Errorf("take leases: no state read for event %s", r.EventID)
		}
		if lt.State == LeaseOwned && tokenOf[r.EventID] != r.Token {
			// The same id twice in reqs: only the first token took it.
			lt = LeaseTake{EventID: r.EventID, State: LeaseBusy}
		}
		out[i] = lt
	}
	return out, nil
}

// CompleteLeases checks the tokens and claims their events in tx: the
// leases still held by their tokens are deleted (and stay locked until tx
// ends, so no takeover slips in) and their claims inserted, in one
// statement. The result, per token in the order given, tells whether to
// write the handler's effects in tx ([Completed]) or to write nothing
// ([CompleteLost], [CompleteDuplicate]). Commit tx with the effects; roll
// it back and the leases stand again, untouched.
func (d *Deduplicator) CompleteLeases(ctx context.Context, tx migrate.DBTX, eventIDs, tokens []uuid.UUID) ([]CompleteResult, error) {
	if len(eventIDs) != len(tokens) {
		return nil, errors.New("complete leases: one token per event id")
	}
	if len(eventIDs) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, d.lease.complete, dbx.UUIDs(eventIDs), d.cfg.ConsumerGroup, dbx.UUIDs(tokens))
	if err != nil {
		return nil, fmt.Errorf("complete leases: %w", err)
	}
	return d.readComplete(rows, tokens)
}

// readComplete reads the complete statement's rows into one result per
// token.
func (d *Deduplicator) readComplete(rows pgx.Rows, tokens []uuid.UUID) ([]CompleteResult, error) {
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
	out := make([]CompleteResult, len(tokens))
	for i, t := range tokens {
		switch claimed, held := got[t]; {
		case !held:
			out[i] = CompleteLost
		case claimed:
			out[i] = Completed
		default:
			out[i] = CompleteDuplicate
		}
	}
	return out, nil
}

// BeginCompleteLeases begins a transaction on db and runs
// [Deduplicator.CompleteLeases] in it: with a pool or a conn, BEGIN and the
// statement travel as one pipelined round trip. A non-nil tx must be
// committed or rolled back by the caller, also with an error.
func (d *Deduplicator) BeginCompleteLeases(ctx context.Context, db migrate.Beginner, eventIDs, tokens []uuid.UUID) (tx pgx.Tx, res []CompleteResult, err error) {
	if len(eventIDs) != len(tokens) {
		return nil, nil, errors.New("complete leases: one token per event id")
	}
	tx, err = beginPipelined(ctx, db, pgx.TxOptions{}, func(b *pgx.Batch) {
		b.Queue(d.lease.complete, dbx.UUIDs(eventIDs), d.cfg.ConsumerGroup, dbx.UUIDs(tokens))
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		res, err = d.readComplete(rows, tokens)
		return err
	}, func(tx pgx.Tx) (err error) {
		res, err = d.CompleteLeases(ctx, tx, eventIDs, tokens)
		return err
	})
	if err != nil {
		return tx, nil, fmt.Errorf("complete leases: %w", err)
	}
	return tx, res, nil
}

// RenewLease extends the lease of eventID held by token to d0 from now on
// the database's clock. It reports false when token no longer holds it.
func (d *Deduplicator) RenewLease(ctx context.Context, db migrate.DBTX, eventID, token uuid.UUID, d0 time.Duration) (bool, error) {
	tag, err := db.Exec(ctx, d.lease.renew, dbx.UUID(eventID), d.cfg.ConsumerGroup, dbx.UUID(token), d0.Microseconds())
	if err != nil {
		return false, fmt.Errorf("renew lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// ReleaseLease deletes the lease of eventID if token still holds it, so the
// next delivery takes a new one at once (after a handler error). It reports
// whether it did.
func (d *Deduplicator) ReleaseLease(ctx context.Context, db migrate.DBTX, eventID, token uuid.UUID) (bool, error) {
	tag, err := db.Exec(ctx, d.lease.release, dbx.UUID(eventID), d.cfg.ConsumerGroup, dbx.UUID(token))
	if err != nil {
		return false, fmt.Errorf("release lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// LeaseFilter selects the leases [Deduplicator.Leases] and [ListLeases]
// list.
type LeaseFilter struct {
	// ConsumerGroup limits the list to one group; "" lists every group.
	ConsumerGroup string
	// State is "live", "expired" or "" (both).
	State string
	// Limit is the most rows returned; 0 means 100.
	Limit int
}

// ListLeases lists the leases of cfg's table, oldest taken first.
func ListLeases(ctx context.Context, db migrate.DBTX, cfg TableConfig, f LeaseFilter) ([]Lease, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	state := f.State
	switch state {
	case "":
		state = "all"
	case "live", "expired":
	default:
		return nil, fmt.Errorf("list leases: state %q: want live, expired or empty", f.State)
	}
	if f.Limit == 0 {
		f.Limit = 100
	}
	rows, err := db.Query(ctx, newLeaseSQL(cfg.Schema, cfg.Table).list, f.ConsumerGroup, state, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list leases: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Lease, error) {
		var l Lease
		err := r.Scan(&l.EventID, &l.ConsumerGroup, &l.Token, &l.TakenAt, &l.ExpiresAt, &l.Attempts, &l.Owner, &l.Expired)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("list leases: %w", err)
	}
	return out, nil
}

// ReleaseLeaseOf deletes the lease of (eventID, group) whoever holds it: an
// operator's action for a lease whose owner is known to be gone. The owner,
// if alive, then fails its completion with a lost lease and writes nothing;
// the next delivery takes a new lease. It reports whether a lease existed.
func ReleaseLeaseOf(ctx context.Context, db migrate.DBTX, cfg TableConfig, eventID uuid.UUID, group string) (bool, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return false, err
	}
	tag, err := db.Exec(ctx, newLeaseSQL(cfg.Schema, cfg.Table).forceRelease, eventID, group)
	if err != nil {
		return false, fmt.Errorf("release lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// LeaseSummary counts the leases of one table, for dashboards and the
// console.
type LeaseSummary struct {
	// Live leases are calls in flight (or owners gone less than a lease
	// ago); Expired ones wait for their event's next delivery.
	Live    int `json:"live"`
	Expired int `json:"expired"`
	// OldestLiveSeconds is how long ago the oldest live lease was taken
	// (0 without one): a call that long, renewed all along.
	OldestLiveSeconds float64 `json:"oldest_live_seconds"`
}

// SummarizeLeases counts the leases of cfg's table in one statement. The
// lease table holds only the calls in flight and the expired leases not
// taken over yet, so it reads few rows.
func SummarizeLeases(ctx context.Context, db migrate.DBTX, cfg TableConfig) (LeaseSummary, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return LeaseSummary{}, err
	}
	var s LeaseSummary
	err := db.QueryRow(ctx, "SELECT count(*) FILTER (WHERE expires_at > now()), count(*) FILTER (WHERE expires_at <= now()), "+
		"coalesce(extract(epoch FROM now() - min(taken_at) FILTER (WHERE expires_at > now())), 0)::float8 FROM "+
		ident.Quote(cfg.Schema, cfg.Table+"_lease")).Scan(&s.Live, &s.Expired, &s.OldestLiveSeconds)
	if err != nil {
		return LeaseSummary{}, fmt.Errorf("summarize leases: %w", err)
	}
	return s, nil
}
