package deduplicator

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// partitionInfo is one partition of the processed_event table.
type partitionInfo struct {
	name      string
	isDefault bool
	parsed    bool // from/to hold the bounds
	from, to  uuid.UUID
}

var boundRe = regexp.MustCompile(`^FOR VALUES FROM \('([0-9a-f-]{36})'\) TO \('([0-9a-f-]{36})'\)$`)

func (c *Cleaner) listPartitions(ctx context.Context, conn *pgx.Conn) ([]partitionInfo, error) {
	rows, err := conn.Query(ctx, `SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) ORDER BY 1`, c.table)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (partitionInfo, error) {
		var p partitionInfo
		var bound string
		if err := r.Scan(&p.name, &bound); err != nil {
			return p, err
		}
		if bound == "DEFAULT" {
			p.isDefault = true
			return p, nil
		}
		if m := boundRe.FindStringSubmatch(bound); m != nil {
			p.from, p.to, p.parsed = uuid.MustParse(m[1]), uuid.MustParse(m[2]), true
		}
		return p, nil
	})
}

// maintainPartitions creates the partitions of today and PartitionsAhead
// days after it, creates a partition for every day within the retention
// that has rows in the DEFAULT partition (moving them), and drops the
// partitions whose upper bound is at or below the cutoff.
//
// A partition that holds claims of a young group is kept: that group's stale
// guard lets old events through, so their claims must stay until the group
// is older than the retention.
func (c *Cleaner) maintainPartitions(ctx context.Context, conn *pgx.Conn, cutoff time.Time, young []string, res *Result) error {
	parts, err := c.listPartitions(ctx, conn)
	if err != nil {
		return fmt.Errorf("cleaner: list partitions: %w", err)
	}
	today := utcDay(c.cfg.NowFunc())
	last := today.AddDate(0, 0, c.cfg.PartitionsAhead)
	hasDefault := slices.ContainsFunc(parts, func(p partitionInfo) bool { return p.isDefault })

	days := map[time.Time]bool{}
	for d := today; !d.After(last); d = d.AddDate(0, 0, 1) {
		days[d] = true
	}
	if hasDefault {
		// Days within the retention (and up to the last ahead day) that have
		// rows in the DEFAULT partition: give them their partition.
		rows, err := conn.Query(ctx, `SELECT DISTINCT (('x' || substr(replace(event_id::text, '-', ''), 1, 12))::bit(48)::bigint / 86400000)
FROM `+ident.Quote(c.cfg.Schema, DefaultPartitionName(c.cfg.Table))+`
WHERE event_id >= $1 AND event_id < $2 AND get_byte(uuid_send(event_id), 6) >> 4 = 7`,
			UUIDv7Floor(utcDay(cutoff)), UUIDv7Floor(last.AddDate(0, 0, 1)))
		if err != nil {
			return fmt.Errorf("cleaner: scan default partition: %w", err)
		}
		epochDays, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return fmt.Errorf("cleaner: scan default partition: %w", err)
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
		from, to := PartitionBounds(d)
		if covered, exact := overlaps(parts, from, to); covered {
			if !exact {
				c.logger.Info("Not creating a daily partition: its range overlaps an existing partition with other bounds", watermill.LogFields{"day": d.Format(time.DateOnly)})
			}
			continue
		}
		moved, err := c.createPartition(ctx, conn, d, hasDefault)
		if err != nil {
			return err
		}
		res.PartitionsCreated++
		res.RowsMoved += moved
		parts = append(parts, partitionInfo{name: PartitionName(c.cfg.Table, d), parsed: true, from: from, to: to})
	}

	boundary := UUIDv7Floor(cutoff)
	for _, p := range parts {
		if p.isDefault || !p.parsed || bytes.Compare(p.to[:], boundary[:]) > 0 {
			continue
		}
		if len(young) > 0 {
			var held bool
			if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+ident.Quote(c.cfg.Schema, p.name)+" WHERE consumer_group = ANY ($1::text[]))", young).Scan(&held); err != nil {
				return fmt.Errorf("cleaner: check partition %s: %w", p.name, err)
			}
			if held {
				c.logger.Info("Keeping an old partition: it holds claims of a consumer group first seen less than a retention ago", watermill.LogFields{"partition": p.name, "young_groups": young})
				res.PartitionsKept++
				continue
			}
		}
		if err := c.dropPartition(ctx, conn, p.name); err != nil {
			return err
		}
		res.PartitionsDropped++
	}
	return nil
}

// overlaps reports whether [from, to) overlaps an existing partition, and
// whether that partition has exactly these bounds.
func overlaps(parts []partitionInfo, from, to uuid.UUID) (covered, exact bool) {
	for _, p := range parts {
		if !p.parsed {
			continue
		}
		if bytes.Compare(p.from[:], to[:]) < 0 && bytes.Compare(from[:], p.to[:]) < 0 {
			return true, p.from == from && p.to == to
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
	name := PartitionName(c.cfg.Table, day)
	qname := ident.Quote(c.cfg.Schema, name)
	from, to := PartitionBounds(day)
	var moved int64
	err := c.ddl(ctx, conn, "create partition "+name, func(tx pgx.Tx) error {
		moved = 0
		if hasDefault {
			if _, err := tx.Exec(ctx, "LOCK TABLE "+ident.Quote(c.cfg.Schema, DefaultPartitionName(c.cfg.Table))+" IN ACCESS EXCLUSIVE MODE"); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE "+qname+" (LIKE "+c.table+" INCLUDING DEFAULTS)"); err != nil {
			return err
		}
		if hasDefault {
			tag, err := tx.Exec(ctx, `WITH moved AS (
	DELETE FROM `+ident.Quote(c.cfg.Schema, DefaultPartitionName(c.cfg.Table))+` WHERE event_id >= $1 AND event_id < $2
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

// dropPartition detaches and drops a partition in one short transaction.
// DETACH needs the parent's ACCESS EXCLUSIVE lock (DETACH CONCURRENTLY is not
// allowed while a DEFAULT partition exists), so the wait is bounded by
// LockTimeout and retried.
func (c *Cleaner) dropPartition(ctx context.Context, conn *pgx.Conn, name string) error {
	qname := ident.Quote(c.cfg.Schema, name)
	err := c.ddl(ctx, conn, "drop partition "+name, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "ALTER TABLE "+c.table+" DETACH PARTITION "+qname); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DROP TABLE "+qname)
		return err
	})
	if err == nil {
		c.logger.Debug("Partition dropped", watermill.LogFields{"partition": name})
	}
	return err
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
		if ctx.Err() != nil || !isLockTimeout(err) || attempt >= c.cfg.LockRetries {
			return fmt.Errorf("cleaner: %s (attempt %d): %w", what, attempt, err)
		}
		pause := cleanerJitter(c.cfg.LockTimeout * time.Duration(attempt))
		c.logger.Info("Partition DDL hit lock_timeout, retrying", watermill.LogFields{"op": what, "attempt": attempt, "pause": pause.String()})
		if err := cleanerSleep(ctx, pause); err != nil {
			return err
		}
	}
}
