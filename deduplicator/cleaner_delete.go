package deduplicator

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// deleteV7 deletes the UUIDv7 rows of table (the plain table or the DEFAULT
// partition) below boundary (the floor of the cutoff), walking the primary
// key upwards in batches; a plan counts them instead.
//
// The claims of young groups (first seen after cutoff) are kept: their
// stale guard lets old events through, so deleting a claim would let a
// redelivery apply it again. The registry is read inside each batch's
// statement, in the snapshot the statement deletes from (see
// docs/retention.md, "A group registering during a pass"): a claim the
// statement can see was committed after its group's registration, so the
// statement sees that registration too; a claim committed later is not
// visible to it, so it cannot be deleted by it.
func (c *Cleaner) deleteV7(ctx context.Context, conn *pgx.Conn, table string, boundary uuid.UUID, cutoff time.Time, res *Result) error {
	// Each batch takes the next rows in primary-key order below the boundary
	// (an index range scan: filtering the version inside the scan would
	// spoil the planner's estimate and turn it into a sort of the whole
	// range), deletes the UUIDv7 ones, and the next batch starts after the
	// last key seen, so skipped rows (non-v7) are not rescanned.
	//
	// Deleted by ctid: the table is a heap and processed_event rows are never
	// updated, so a row's ctid is stable within the statement. No FOR
	// UPDATE: claims never lock existing rows (ON CONFLICT DO NOTHING does
	// not), and locking would write every tuple twice.
	old := `get_byte(uuid_send(b.event_id), 6) >> 4 = 7 AND NOT EXISTS (
		SELECT 1 FROM ` + companion(c.cfg.TableConfig, dedupsql.GroupSuffix) + ` g WHERE g.consumer_group = b.consumer_group AND g.first_seen_at > $5)`
	del := `DELETE FROM ` + table + ` WHERE ctid = ANY (ARRAY (SELECT b.ctid FROM batch b WHERE ` + old + `))
	RETURNING 1`
	if c.plan {
		del = `SELECT 1 FROM batch b WHERE ` + old
	}
	q := `WITH batch AS MATERIALIZED (
	SELECT ctid, event_id, consumer_group FROM ` + table + `
	WHERE (event_id, consumer_group) > ($1, $2) AND event_id < $3
	ORDER BY event_id, consumer_group LIMIT $4
), del AS (
	` + del + `
), last AS (
	SELECT event_id, consumer_group FROM batch ORDER BY event_id DESC, consumer_group DESC LIMIT 1
)
SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM del), last.event_id, last.consumer_group
FROM (SELECT 1) one LEFT JOIN last ON true`
	var (
		fromID    = uuid.Nil
		fromGroup = ""
	)
	return c.batches(ctx, conn, res, func(tx pgx.Tx, limit int) (scanned, deleted int64, err error) {
		var lastID *uuid.UUID
		var lastGroup *string
		if err := tx.QueryRow(ctx, q, fromID, fromGroup, boundary, limit, cutoff).Scan(&scanned, &deleted, &lastID, &lastGroup); err != nil {
			return 0, 0, err
		}
		if lastID != nil && lastGroup != nil {
			fromID, fromGroup = *lastID, *lastGroup
		}
		return scanned, deleted, nil
	})
}

// deleteNonV7 deletes non-v7 rows processed before cutoff; a plan counts
// them in one statement (nothing is deleted, so batches would not advance).
// No young group's claim qualifies: processed_at is the database's now() of
// the claiming transaction, which began after the group's registration
// committed, so it is later than first_seen_at, itself later than cutoff.
func (c *Cleaner) deleteNonV7(ctx context.Context, conn *pgx.Conn, cutoff time.Time, res *Result) error {
	if c.plan {
		q := `SELECT count(*) FROM ` + c.table + ` WHERE processed_at < $1 AND get_byte(uuid_send(event_id), 6) >> 4 <> 7`
		return c.batches(ctx, conn, res, func(tx pgx.Tx, _ int) (int64, int64, error) {
			var n int64
			err := tx.QueryRow(ctx, q, cutoff).Scan(&n)
			return 0, n, err
		})
	}
	q := `DELETE FROM ` + c.table + ` WHERE ctid = ANY (ARRAY (` + nonV7Batch(c.table) + `))`
	return c.batches(ctx, conn, res, func(tx pgx.Tx, limit int) (int64, int64, error) {
		tag, err := tx.Exec(ctx, q, cutoff, limit)
		return tag.RowsAffected(), tag.RowsAffected(), err
	})
}

// nonV7Batch selects the next batch of non-v7 rows older than $1, at most
// $2, oldest first. Its WHERE states the predicate of the partial
// processed_at index (migration 004) word for word, so the planner can
// read the batch from that index.
func nonV7Batch(table string) string {
	return `SELECT ctid FROM ` + table + `
	WHERE processed_at < $1 AND get_byte(uuid_send(event_id), 6) >> 4 <> 7
	ORDER BY processed_at LIMIT $2`
}

// batches runs batch in its own transaction until it scans fewer rows than
// asked, backing off and shrinking the batch when one hits the statement
// timeout.
func (c *Cleaner) batches(ctx context.Context, conn *pgx.Conn, res *Result, batch func(tx pgx.Tx, limit int) (scanned, deleted int64, err error)) error {
	limit := c.cfg.BatchSize
	consecutive := 0
	setTimeout := "SET LOCAL statement_timeout = " + strconv.FormatInt(c.cfg.StatementTimeout.Milliseconds(), 10)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		c.at(stepBatch, conn, res.Batches)
		var scanned int64
		n, err := c.inTx(ctx, conn, func(tx pgx.Tx) (int64, error) {
			if c.cfg.StatementTimeout > 0 {
				if _, err := tx.Exec(ctx, setTimeout); err != nil {
					return 0, err
				}
			}
			s, d, err := batch(tx, limit)
			scanned = s
			return d, err
		})
		if err != nil {
			if ctx.Err() != nil || !isStatementTimeout(err) {
				return fmt.Errorf("cleaner: delete batch: %w", err)
			}
			res.Timeouts++
			consecutive++
			if consecutive >= c.cfg.MaxTimeouts {
				return fmt.Errorf("%w (%d in a row, batch size %d): %w", ErrCleanerTimeout, consecutive, limit, err)
			}
			limit = max(limit/2, min(minBatchSize, c.cfg.BatchSize))
			pause := c.cfg.Backoff << (consecutive - 1)
			c.logger.Info("Retention batch hit statement_timeout, backing off", watermill.LogFields{
				"batch_size": limit, "pause": pause.String(), "consecutive": consecutive,
			})
			if err := wait.Sleep(ctx, pause); err != nil {
				return err
			}
			continue
		}
		consecutive = 0
		res.Batches++
		res.Deleted += n
		c.logger.Trace("Retention batch deleted", watermill.LogFields{"rows": n})
		if scanned < int64(limit) {
			return nil
		}
	}
}

// inTx runs fn in a transaction on conn and commits it; a read-only one in
// a plan.
func (c *Cleaner) inTx(ctx context.Context, conn *pgx.Conn, fn func(tx pgx.Tx) (int64, error)) (int64, error) {
	var opts pgx.TxOptions
	if c.plan {
		opts.AccessMode = pgx.ReadOnly
	}
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return 0, err
	}
	n, err := fn(tx)
	if err != nil {
		cleanerRollback(ctx, tx)
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	return n, nil
}

func cleanerRollback(ctx context.Context, tx pgx.Tx) {
	_ = tx.Rollback(context.WithoutCancel(ctx)) // ErrTxClosed and a dead conn both mean nothing is left to undo
}

func isStatementTimeout(err error) bool {
	return pgerr.Has(err, pgerrcode.QueryCanceled)
}

func isLockTimeout(err error) bool {
	return pgerr.Has(err, pgerrcode.LockNotAvailable, pgerrcode.DeadlockDetected)
}
