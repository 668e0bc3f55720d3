package deduplicator

import (
	"bytes"
	"context"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Deduplicator claims event ids for one consumer group in a processed_event
// table.
type Deduplicator struct {
	cfg    Config
	logger watermill.LoggerAdapter
	stale  staleState
	table  string // quoted schema.table

	claimSQL       string
	claimBatchSQL  string
	processedAtSQL string
	// leases is lease mode's protocol on the table for the group; the
	// middleware reaches it through leasesql.Of.
	leases *leasesql.Protocol
}

// New returns a Deduplicator. It does not touch the database; migrate [MigrationLine] up
// first.
func New(cfg Config, logger watermill.LoggerAdapter) (*Deduplicator, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("deduplicator: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	t := ident.Quote(cfg.Schema, cfg.Table)
	return &Deduplicator{
		cfg:            cfg,
		logger:         logger,
		table:          t,
		claimSQL:       claimsql.Claim(t),
		claimBatchSQL:  claimsql.ClaimBatch(t),
		processedAtSQL: "SELECT processed_at FROM " + t + " WHERE event_id = $1 AND consumer_group = $2",
		leases:         newLeases(cfg),
	}, nil
}

// Claim records eventID as processed by the consumer group inside tx and
// reports whether this is the first claim (true) or a duplicate (false).
//
// It uses INSERT ... ON CONFLICT DO NOTHING: if another transaction holds an
// uncommitted claim of the same id, Claim waits for it; when that transaction
// commits, Claim returns false; when it rolls back, Claim returns true. Under
// REPEATABLE READ or SERIALIZABLE the wait ends with a serialization failure
// (SQLSTATE 40001) instead, which the caller must retry, never treat as
// processed.
//
// The claim is only visible to others once tx commits, so commit it together
// with the business writes it protects.
func (d *Deduplicator) Claim(ctx context.Context, tx migrate.DBTX, eventID uuid.UUID) (first bool, err error) {
	tag, err := tx.Exec(ctx, d.claimSQL, dbx.UUID(eventID), d.cfg.ConsumerGroup)
	if err != nil {
		return false, fmt.Errorf("claim event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// BeginClaim begins a transaction on db and claims eventID in it, as
// [Deduplicator.Claim] does. With a *pgxpool.Pool or a *pgx.Conn, BEGIN and
// the claim travel as one pipelined batch: one round trip instead of two.
// opts apply when db has BeginTx (a pool and a conn do); a pgx.Tx begins a
// savepoint.
//
// A non-nil tx must be committed or rolled back by the caller, also when err
// is not nil (for a pool that releases the connection); a nil tx comes with
// an error and nothing to release. A duplicate's claim inserts nothing, so
// its transaction gets no transaction id and its ROLLBACK writes no WAL.
func (d *Deduplicator) BeginClaim(ctx context.Context, db migrate.Beginner, opts pgx.TxOptions, eventID uuid.UUID) (tx pgx.Tx, first bool, err error) {
	pending := progresssql.From(ctx) // the consumer's progress, in the same round trip
	tx, err = dbx.BeginPipelined(ctx, db, opts, func(b *pgx.Batch) {
		b.Queue(d.claimSQL, dbx.UUID(eventID), d.cfg.ConsumerGroup)
		pending.Queue(b)
	}, func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		first = tag.RowsAffected() == 1
		if err != nil {
			return err
		}
		return pending.Read(br)
	}, func(tx pgx.Tx) (err error) {
		if first, err = d.Claim(ctx, tx, eventID); err != nil {
			return err
		}
		return pending.Exec(ctx, tx)
	})
	if err != nil {
		return tx, false, fmt.Errorf("claim event %s: %w", eventID, err)
	}
	return tx, first, nil
}

// BeginClaimBatch is [Deduplicator.BeginClaim] for several ids: BEGIN and one
// multi-row claim ([Deduplicator.ClaimBatch]: sorted ids, so batches sharing
// ids cannot deadlock) in one round trip with a pool or a conn. It returns
// the ids claimed for the first time, sorted; the others are duplicates.
// The same rules for tx apply.
func (d *Deduplicator) BeginClaimBatch(ctx context.Context, db migrate.Beginner, opts pgx.TxOptions, eventIDs []uuid.UUID) (tx pgx.Tx, first []uuid.UUID, err error) {
	ids := sortedUnique(eventIDs)
	pending := progresssql.From(ctx) // the consumers' progress, in the same round trip
	tx, err = dbx.BeginPipelined(ctx, db, opts, func(b *pgx.Batch) {
		b.Queue(d.claimBatchSQL, dbx.UUIDs(ids), d.cfg.ConsumerGroup)
		pending.Queue(b)
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		if first, err = collectUUIDs(rows); err != nil {
			return err
		}
		return pending.Read(br)
	}, func(tx pgx.Tx) (err error) {
		if first, err = d.ClaimBatch(ctx, tx, ids); err != nil {
			return err
		}
		return pending.Exec(ctx, tx)
	})
	if err != nil {
		return tx, nil, fmt.Errorf("claim batch of %d: %w", len(ids), err)
	}
	slices.SortFunc(first, compareUUID)
	return tx, first, nil
}

// ClaimBatch claims several ids in one statement and returns those claimed
// for the first time, sorted. Ids are inserted in sorted order, so two
// batches that share ids lock them in the same order and cannot deadlock.
func (d *Deduplicator) ClaimBatch(ctx context.Context, tx migrate.DBTX, eventIDs []uuid.UUID) ([]uuid.UUID, error) {
	if len(eventIDs) == 0 {
		return nil, nil
	}
	ids := sortedUnique(eventIDs)
	rows, err := tx.Query(ctx, d.claimBatchSQL, dbx.UUIDs(ids), d.cfg.ConsumerGroup)
	if err != nil {
		return nil, fmt.Errorf("claim batch: %w", err)
	}
	first, err := collectUUIDs(rows)
	if err != nil {
		return nil, fmt.Errorf("claim batch: %w", err)
	}
	slices.SortFunc(first, func(a, b uuid.UUID) int { return compareUUID(a, b) })
	return first, nil
}

// collectUUIDs reads rows of one uuid column and closes rows. A column in
// binary format (the extended protocol's) is copied from the row's raw
// bytes: pgx.CollectRows with Scan allocated several times per row, on
// every claim of the group commit. Anything else (text format under the
// simple protocol, a NULL) goes through Scan as before.
func collectUUIDs(rows pgx.Rows) ([]uuid.UUID, error) {
	defer rows.Close()
	ids := []uuid.UUID{} // as pgx.CollectRows: empty, not nil, without rows
	for rows.Next() {
		if fd := rows.FieldDescriptions(); len(fd) == 1 && fd[0].Format == pgx.BinaryFormatCode && fd[0].DataTypeOID == pgtype.UUIDOID {
			if v := rows.RawValues(); len(v) == 1 && len(v[0]) == 16 {
				ids = append(ids, uuid.UUID(v[0]))
				continue
			}
		}
		var id uuid.UUID
		if err := rows.Scan(dbx.UUIDDest(&id)); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// sortedUnique returns a sorted copy of ids without repeats.
func sortedUnique(ids []uuid.UUID) []uuid.UUID {
	out := slices.Clone(ids)
	slices.SortFunc(out, compareUUID)
	return slices.Compact(out)
}

// compareUUID orders ids as PostgreSQL's uuid type does (bytewise).
func compareUUID(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) }
