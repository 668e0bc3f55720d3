package deduplicator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// maintainPartitions creates the partitions of today and PartitionsAhead
// days after it, creates a partition for every day within the retention
// that has rows in the DEFAULT partition (moving them), and drops the
// partitions whose upper bound is at or below the cutoff.
//
// A partition that holds claims of a young group is kept: that group's stale
// guard lets old events through, so their claims must stay until the group
// is older than the retention. The check and the drop are one transaction
// that first locks the partition against claims (see dropPartition).
//
// A plan creates, moves and drops nothing: it counts the rows it would
// move and names the partitions. It returns the lowest bound of the
// partitions it created (or would create), uuid.Nil when none.
func (c *Cleaner) maintainPartitions(ctx context.Context, conn *pgx.Conn, now, cutoff time.Time, res *Result) (movedFrom uuid.UUID, err error) {
	parts, err := partition.List(ctx, conn, c.table)
	if err != nil {
		return uuid.Nil, fmt.Errorf("cleaner: list partitions: %w", err)
	}
	today := partition.UTCDay(now)
	last := today.AddDate(0, 0, c.cfg.PartitionsAhead)
	hasDefault := slices.ContainsFunc(parts, func(p partition.Info) bool { return p.Default })

	days := map[time.Time]bool{}
	for d := today; !d.After(last); d = d.AddDate(0, 0, 1) {
		days[d] = true
	}
	if hasDefault {
		// Days within the retention (and up to the last ahead day) that have
		// rows in the DEFAULT partition: give them their partition.
		rows, err := conn.Query(ctx, `SELECT DISTINCT (('x' || substr(replace(event_id::text, '-', ''), 1, 12))::bit(48)::bigint / 86400000)
FROM `+ident.Quote(c.cfg.Schema, partition.DefaultName(c.cfg.Table))+`
WHERE event_id >= $1 AND event_id < $2 AND get_byte(uuid_send(event_id), 6) >> 4 = 7`,
			partition.Floor(partition.UTCDay(cutoff)), partition.Floor(last.AddDate(0, 0, 1)))
		if err != nil {
			return uuid.Nil, fmt.Errorf("cleaner: scan default partition: %w", err)
		}
		epochDays, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return uuid.Nil, fmt.Errorf("cleaner: scan default partition: %w", err)
		}
		for _, n := range epochDays {
			days[time.Unix(n*86400, 0).UTC()] = true
		}
	}
	sorted := make([]time.Time, 0, len(days))
	for d := range days {
		sorted = append(sorted, d)
	}
	slices.SortFunc(sorted, func(a, b time.Time) int { return a.Compare(b) })

	for _, d := range sorted {
		from, to := partition.Bounds(d)
		if covered, exact := overlaps(parts, from, to); covered {
			if !exact {
				c.logger.Info("Not creating a daily partition: its range overlaps an existing partition with other bounds", watermill.LogFields{"day": d.Format(time.DateOnly)})
			}
			continue
		}
		var moved int64
		if c.plan {
			moved, err = c.countDefault(ctx, conn, from, to, hasDefault)
		} else {
			moved, err = c.createPartition(ctx, conn, d, hasDefault)
		}
		if err != nil {
			return uuid.Nil, err
		}
		if movedFrom == uuid.Nil || bytes.Compare(from[:], movedFrom[:]) < 0 {
			movedFrom = from
		}
		res.PartitionsCreated = append(res.PartitionsCreated, partition.Name(c.cfg.Table, d))
		res.RowsMoved += moved
		parts = append(parts, partition.Info{Name: partition.Name(c.cfg.Table, d), Ranged: true, FromID: from, ToID: to})
	}

	return movedFrom, c.dropOld(ctx, conn, parts, cutoff, res)
}

// dropOld drops the partitions whose upper bound is at or below the
// cutoff's floor, keeping those that hold a young group's claims.
func (c *Cleaner) dropOld(ctx context.Context, conn *pgx.Conn, parts []partition.Info, cutoff time.Time, res *Result) error {
	boundary := partition.Floor(cutoff)
	for _, p := range parts {
		if p.Default || !p.Ranged || bytes.Compare(p.ToID[:], boundary[:]) > 0 {
			continue
		}
		c.at(stepDrop, conn, 0)
		dropped, err := c.dropPartition(ctx, conn, p.Name, cutoff)
		if err != nil {
			return err
		}
		if !dropped {
			c.logger.Info("Keeping an old partition: it holds claims of a consumer group first seen less than a retention ago", watermill.LogFields{"partition": p.Name})
			res.PartitionsKept = append(res.PartitionsKept, p.Name)
			continue
		}
		res.PartitionsDropped = append(res.PartitionsDropped, p.Name)
	}
	return nil
}

// countDefault counts the rows of the DEFAULT partition in [from, to): what
// createPartition would move.
func (c *Cleaner) countDefault(ctx context.Context, conn *pgx.Conn, from, to uuid.UUID, hasDefault bool) (int64, error) {
	if !hasDefault {
		return 0, nil
	}
	var n int64
	err := conn.QueryRow(ctx, "SELECT count(*) FROM "+ident.Quote(c.cfg.Schema, partition.DefaultName(c.cfg.Table))+
		" WHERE event_id >= $1 AND event_id < $2", from, to).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("cleaner: count default partition rows: %w", err)
	}
	return n, nil
}

// overlaps reports whether [from, to) overlaps an existing partition, and
// whether that partition has exactly these bounds.
func overlaps(parts []partition.Info, from, to uuid.UUID) (covered, exact bool) {
	for _, p := range parts {
		if !p.Ranged {
			continue
		}
		if bytes.Compare(p.FromID[:], to[:]) < 0 && bytes.Compare(from[:], p.ToID[:]) < 0 {
			return true, p.FromID == from && p.ToID == to
		}
	}
	return false, false
}

// createPartition creates the daily partition of day without ever taking
// the parent's ACCESS EXCLUSIVE lock, in one transaction:
//
//  1. lock the DEFAULT partition (claims routed to it wait; others do not);
//  2. create the new table standalone;
//  3. move the DEFAULT partition's rows of that day into it;
//  4. ATTACH it (SHARE UPDATE EXCLUSIVE on the parent, which claims do not
//     conflict with); PostgreSQL checks the DEFAULT partition holds no row
//     of the new range, which step 3 ensured under the lock.
//
// The move and the attach commit together, so every row stays visible in
// exactly one partition. A claim that was already routed to the DEFAULT
// partition and waited on the lock fails with a partition-constraint error
// (SQLSTATE 23514) after the commit and is retried by the router: it never
// inserts a second row for a moved event.
func (c *Cleaner) createPartition(ctx context.Context, conn *pgx.Conn, day time.Time, hasDefault bool) (int64, error) {
	name := partition.Name(c.cfg.Table, day)
	qname := ident.Quote(c.cfg.Schema, name)
	from, to := partition.Bounds(day)
	var moved int64
	err := c.ddl(ctx, conn, "create partition "+name, func(tx pgx.Tx) error {
		moved = 0
		if hasDefault {
			if _, err := tx.Exec(ctx, "LOCK TABLE "+ident.Quote(c.cfg.Schema, partition.DefaultName(c.cfg.Table))+" IN ACCESS EXCLUSIVE MODE"); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE "+qname+" (LIKE "+c.table+" INCLUDING DEFAULTS)"); err != nil {
			return err
		}
		if hasDefault {
			tag, err := tx.Exec(ctx, `WITH moved AS (
	DELETE FROM `+ident.Quote(c.cfg.Schema, partition.DefaultName(c.cfg.Table))+` WHERE event_id >= $1 AND event_id < $2
	RETURNING event_id, consumer_group, processed_at
) INSERT INTO `+qname+` (event_id, consumer_group, processed_at) SELECT event_id, consumer_group, processed_at FROM moved`, from, to)
			if err != nil {
				return err
			}
			moved = tag.RowsAffected()
		}
		_, err := tx.Exec(ctx, "ALTER TABLE "+c.table+" ATTACH PARTITION "+qname+
			" FOR VALUES FROM ('"+from.String()+"') TO ('"+to.String()+"')")
		return err
	})
	if err != nil {
		return 0, err
	}
	c.logger.Debug("Partition created", watermill.LogFields{"partition": name, "rows_moved": moved})
	return moved, nil
}

// errKeep rolls back a drop whose partition holds a young group's claims.
var errKeep = errors.New("partition holds claims of a young consumer group")

// dropPartition detaches and drops a partition unless it holds a claim of a
// consumer group first seen after cutoff (young), and reports whether it
// dropped it. One transaction:
//
//  1. LOCK the partition IN SHARE MODE: claims into it (events older than
//     the retention, which only a young group's stale guard lets through)
//     wait until the transaction ends; claims into other partitions do not;
//  2. look for a young group's claim in it, reading the registry in the
//     same statement: every claim in the partition has committed, and so
//     has its group's registration, before that statement's snapshot;
//  3. DETACH (the parent's ACCESS EXCLUSIVE lock: DETACH CONCURRENTLY is not
//     allowed while a DEFAULT partition exists) and DROP it.
//
// A claim waiting in step 1 is routed again after the commit, to the
// DEFAULT partition, whose deletes keep young groups' claims. Each lock wait
// is bounded by LockTimeout and retried. A claim that holds the parent's
// lock and waits for the partition while step 3 waits for the parent is a
// deadlock: PostgreSQL cancels one of the two (the Cleaner retries; a
// consumer's transaction fails and its message is retried), and nothing is
// deleted that a young group claimed. A plan checks without locking.
func (c *Cleaner) dropPartition(ctx context.Context, conn *pgx.Conn, name string, cutoff time.Time) (bool, error) {
	qname := ident.Quote(c.cfg.Schema, name)
	held := `SELECT CASE WHEN cardinality(y.a) = 0 THEN false
	ELSE EXISTS (SELECT 1 FROM ` + qname + ` WHERE consumer_group = ANY (y.a)) END
FROM (SELECT ARRAY (SELECT consumer_group FROM ` + companion(c.cfg.TableConfig, dedupsql.GroupSuffix) + ` WHERE first_seen_at > $1) AS a) y`
	if c.plan {
		var keep bool
		if err := conn.QueryRow(ctx, held, cutoff).Scan(&keep); err != nil {
			return false, fmt.Errorf("cleaner: check partition %s: %w", name, err)
		}
		return !keep, nil
	}
	err := c.ddl(ctx, conn, "drop partition "+name, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "LOCK TABLE "+qname+" IN SHARE MODE"); err != nil {
			return err
		}
		var keep bool
		if err := tx.QueryRow(ctx, held, cutoff).Scan(&keep); err != nil {
			return err
		}
		if keep {
			return errKeep
		}
		if _, err := tx.Exec(ctx, "ALTER TABLE "+c.table+" DETACH PARTITION "+qname); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DROP TABLE "+qname)
		return err
	})
	if errors.Is(err, errKeep) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	c.logger.Debug("Partition dropped", watermill.LogFields{"partition": name})
	return true, nil
}

// ddl runs fn in a transaction with lock_timeout = LockTimeout, retrying
// after a lock timeout (SQLSTATE 55P03) up to LockRetries times.
func (c *Cleaner) ddl(ctx context.Context, conn *pgx.Conn, what string, fn func(tx pgx.Tx) error) error {
	setLockTimeout := "SET LOCAL lock_timeout = " + strconv.FormatInt(c.cfg.LockTimeout.Milliseconds(), 10)
	for attempt := 1; ; attempt++ {
		_, err := c.inTx(ctx, conn, func(tx pgx.Tx) (int64, error) {
			if _, err := tx.Exec(ctx, setLockTimeout); err != nil {
				return 0, err
			}
			return 0, fn(tx)
		})
		if err == nil {
			return nil
		}
		if errors.Is(err, errKeep) {
			return err
		}
		if ctx.Err() != nil || !isLockTimeout(err) || attempt >= c.cfg.LockRetries {
			return fmt.Errorf("cleaner: %s (attempt %d): %w", what, attempt, err)
		}
		pause := cleanerJitter(c.cfg.LockTimeout * time.Duration(attempt))
		c.logger.Info("Partition DDL hit lock_timeout, retrying", watermill.LogFields{"op": what, "attempt": attempt, "pause": pause.String()})
		if err := wait.Sleep(ctx, pause); err != nil {
			return err
		}
	}
}
