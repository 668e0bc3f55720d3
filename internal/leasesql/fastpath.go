package leasesql

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Open begins the fast path's transaction on db: it takes the advisory
// locks of reqs' events and reads each one's state, in the round trip of
// BEGIN. Each request gets one [Take], in the order of reqs: done (a
// claim exists), busy (another delivery's live lease, or another
// transaction holds the event's lock; or the same id earlier in reqs) or
// owned. An owned event has no lease row: the transaction's advisory lock
// holds it until [Protocol.Finish] and COMMIT write its claim or its
// lease. TakenOver marks one whose expired lease Finish replaces. The
// server ends the session if the transaction stays idle for d (the
// lease's duration): a client gone without a reset then holds its events
// no longer than a lease would. A non-nil tx must be committed or rolled
// back by the caller, also with an error.
func (p *Protocol) Open(ctx context.Context, db dbx.Beginner, reqs []Request, d time.Duration) (tx pgx.Tx, takes []Take, err error) {
	sorted := dedupSorted(reqs)
	ids := make([]uuid.UUID, len(sorted))
	for i, r := range sorted {
		ids[i] = r.EventID
	}
	keys, pids := p.lockKeys(ids), dbx.UUIDs(ids)
	idle := strconv.FormatInt(max(d.Milliseconds(), 1), 10)
	var byID map[uuid.UUID]Take
	// read reads the locks the events' keys found held, then the states.
	read := func(query func(sql string, args ...any) (pgx.Rows, error)) error {
		rows, err := query(p.sql.fastLock, keys)
		if err != nil {
			return err
		}
		held, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		if rows, err = query(p.sql.fastState, pids, p.group); err != nil {
			return err
		}
		if byID, err = readFastStates(rows, len(ids)); err != nil {
			return err
		}
		for i, id := range ids {
			if slices.Contains(held, keys[i]) && byID[id].State != Done {
				byID[id] = Take{EventID: id, State: Busy}
			}
		}
		return nil
	}
	tx, err = dbx.BeginPipelined(ctx, db, pgx.TxOptions{}, func(b *pgx.Batch) {
		b.Queue(setIdleTimeout, idle)
		b.Queue(p.sql.fastLock, keys)
		b.Queue(p.sql.fastState, pids, p.group)
	}, func(br pgx.BatchResults) error {
		if _, err := br.Exec(); err != nil {
			return err
		}
		return read(func(string, ...any) (pgx.Rows, error) { return br.Query() })
	}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setIdleTimeout, idle); err != nil {
			return err
		}
		return read(func(sql string, args ...any) (pgx.Rows, error) { return tx.Query(ctx, sql, args...) })
	})
	if err != nil {
		return tx, nil, fmt.Errorf("open leases: %w", err)
	}
	takes, err = inOrder(reqs, sorted, byID)
	return tx, takes, err
}

// setIdleTimeout bounds how long the fast path's transaction may stay idle
// before the server ends its session.
const setIdleTimeout = "SELECT set_config('idle_in_transaction_session_timeout', $1, true)"

// readFastStates reads the fast path's state rows.
func readFastStates(rows pgx.Rows, n int) (map[uuid.UUID]Take, error) {
	byID := make(map[uuid.UUID]Take, n)
	var (
		id                    uuid.UUID
		claimed, leased, live bool
		remain                int64
		attempts              int
	)
	_, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id), &claimed, &leased, &live, &remain, &attempts}, func() error {
		lt := Take{EventID: id}
		switch {
		case claimed:
			lt.State = Done
		case live:
			lt.State, lt.Remaining = Busy, time.Duration(remain)*time.Microsecond
		default:
			lt.State, lt.TakenOver, lt.Attempts = Owned, leased, attempts+1
		}
		byID[id] = lt
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read states: %w", err)
	}
	return byID, nil
}

// Finish writes the fast path's outcome in tx, opened by [Protocol.Open],
// in one round trip: the claims of the events whose handlers returned
// (finished; takenOver names those of them that had an expired lease,
// deleted now), and leases for the events whose handlers still run
// (running: each one's token, live d from now on the database's clock,
// recorded with owner). It returns one Result per finished id, in order:
// [Completed], or [Duplicate] when another mode's claim got there first.
// The handlers' writes follow in tx, then COMMIT.
func (p *Protocol) Finish(ctx context.Context, tx pgx.Tx, finished, takenOver []uuid.UUID, running []Request, d time.Duration, owner string) ([]Result, error) {
	b := &pgx.Batch{}
	read := p.queueFinish(b, finished, takenOver, running, d, owner, false)
	if b.Len() == 0 {
		return nil, nil
	}
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	res, err := read(br)
	if err != nil {
		return nil, err
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("finish leases: %w", err)
	}
	return res, nil
}

// QueueFinishAll queues [Protocol.Finish]'s statements in b, for a
// pipeline in tx with the handlers' writes after them, and returns the
// reader of their results, to call first. Its claim statement fails
// unless every finished event is claimed: the reader then returns
// [ErrNotAllHeld], and tx must be rolled back (an event was claimed by
// another mode meanwhile; [Protocol.Open] anew tells which).
func (p *Protocol) QueueFinishAll(b *pgx.Batch, finished, takenOver []uuid.UUID, running []Request, d time.Duration, owner string) (read func(pgx.BatchResults) error) {
	r := p.queueFinish(b, finished, takenOver, running, d, owner, true)
	return func(br pgx.BatchResults) error {
		_, err := r(br)
		return err
	}
}

// queueFinish queues the finish statements in b and returns their reader;
// strict: the claim is fastClaimAll (every finished event Completed, or
// [ErrNotAllHeld]).
func (p *Protocol) queueFinish(b *pgx.Batch, finished, takenOver []uuid.UUID, running []Request, d time.Duration, owner string, strict bool) func(pgx.BatchResults) ([]Result, error) {
	if len(takenOver) > 0 {
		b.Queue(p.sql.fastTakeOver, dbx.UUIDs(takenOver), p.group)
	}
	if len(finished) > 0 {
		claim := p.sql.fastClaim
		if strict {
			claim = p.sql.fastClaimAll
		}
		b.Queue(claim, dbx.UUIDs(finished), p.group)
	}
	if len(running) > 0 {
		ids, toks := make([]uuid.UUID, len(running)), make([]uuid.UUID, len(running))
		for i, r := range running {
			ids[i], toks[i] = r.EventID, r.Token
		}
		b.Queue(p.sql.fastLease, dbx.UUIDs(ids), dbx.UUIDs(toks), p.group, d.Microseconds(), owner)
	}
	return func(br pgx.BatchResults) ([]Result, error) {
		if len(takenOver) > 0 {
			if _, err := br.Exec(); err != nil {
				return nil, fmt.Errorf("finish leases: take over: %w", err)
			}
		}
		claimed := map[uuid.UUID]bool{}
		switch {
		case len(finished) > 0 && strict:
			if err := readAll(br); err != nil {
				return nil, fmt.Errorf("finish leases: claim: %w", err)
			}
			for _, id := range finished {
				claimed[id] = true
			}
		case len(finished) > 0:
			rows, _ := br.Query()
			var id uuid.UUID
			if _, err := pgx.ForEachRow(rows, []any{dbx.UUIDDest(&id)}, func() error {
				claimed[id] = true
				return nil
			}); err != nil {
				return nil, fmt.Errorf("finish leases: claim: %w", err)
			}
		}
		if len(running) > 0 {
			if _, err := br.Exec(); err != nil {
				return nil, fmt.Errorf("finish leases: lease the running: %w", err)
			}
		}
		out := make([]Result, len(finished))
		for i, id := range finished {
			out[i] = Duplicate
			if claimed[id] {
				out[i] = Completed
			}
		}
		return out, nil
	}
}
