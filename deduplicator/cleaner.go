package deduplicator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// Cleaner defaults.
const (
	// defaultCleanerBatchSize is the number of rows deleted per transaction.
	defaultCleanerBatchSize = 10_000
	// defaultCleanerInterval is the pause between two passes of [Cleaner.Run].
	defaultCleanerInterval = 10 * time.Minute
	// defaultCleanerStatementTimeout bounds each batch (statement_timeout).
	defaultCleanerStatementTimeout = 10 * time.Second
	// defaultCleanerBackoff is the first pause after a batch hit the
	// statement timeout; it doubles with each consecutive timeout.
	defaultCleanerBackoff = time.Second
	// defaultCleanerMaxTimeouts is how many consecutive timed-out batches end
	// a pass with an error.
	defaultCleanerMaxTimeouts = 5
	// defaultPartitionsAhead is how many days of partitions after today's
	// exist at all times in the partitioned layout.
	defaultPartitionsAhead = 3
	// defaultPartitionLockTimeout bounds how long partition DDL waits for
	// its lock (lock_timeout). Claims queue behind a waiting ACCESS
	// EXCLUSIVE request, so this is also about the longest a claim waits.
	defaultPartitionLockTimeout = 500 * time.Millisecond
	// defaultPartitionLockRetries is how many times partition DDL is retried
	// after a lock timeout before the pass gives up (the next pass retries).
	defaultPartitionLockRetries = 5
)

// minBatchSize is the floor the batch size is halved down to after timeouts.
const minBatchSize = 100

// CleanerConfig configures a [Cleaner].
type CleanerConfig struct {
	TableConfig

	// DB gives the cleaner one connection per pass (the session advisory
	// lock that elects the single working instance belongs to a
	// connection): a pool, like ForwarderConfig.DB. Required.
	DB *pgxpool.Pool

	// BatchSize is the number of rows deleted per transaction. Defaults to
	// 10,000.
	BatchSize int

	// Interval is the pause between passes of [Cleaner.Run]. Defaults to
	// 10 minutes.
	Interval time.Duration

	// StatementTimeout bounds each batch (SET LOCAL statement_timeout).
	// Defaults to 10 s.
	StatementTimeout time.Duration

	// Backoff is the pause after a batch hit StatementTimeout (SQLSTATE
	// 57014); it doubles per consecutive timeout and the batch size halves
	// (down to 100). Defaults to 1 s.
	Backoff time.Duration

	// MaxTimeouts consecutive timed-out batches end the pass with
	// [ErrCleanerTimeout]. Defaults to 5.
	MaxTimeouts int

	// DeleteNonV7 also deletes rows whose event id is not a UUIDv7 (they
	// carry no time) by processed_at older than Retention, through the
	// partial processed_at index of the non-v7 rows. Set it when the middleware runs with AllowNonV7.
	// Plain layout only. Defaults to false.
	DeleteNonV7 bool

	// PartitionsAhead is how many daily partitions after today's the
	// partitioned layout keeps ready. Defaults to 3.
	PartitionsAhead int

	// LockTimeout bounds the wait for the locks of partition DDL (create,
	// detach, drop), so concurrent claims are never queued behind it for
	// longer. Defaults to 500 ms.
	LockTimeout time.Duration

	// LockRetries is how many times partition DDL is retried after a lock
	// timeout, with a jittered pause. Defaults to 5.
	LockRetries int

	// NowFunc, when set, stands in for the database's clock: tests and
	// simulations use it to run a pass as if it were later. Leave it nil in
	// production: every pass then reads the database's clock (now()) and
	// computes the cutoff, the young groups, the days of the partitions and
	// the delay of a shortened retention from it, so that no host's clock
	// decides what is deleted. Defaults to nil (the database's clock).
	NowFunc func() time.Time
}

func (c *CleanerConfig) setDefaults() {
	c.TableConfig.setDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = defaultCleanerBatchSize
	}
	if c.Interval == 0 {
		c.Interval = defaultCleanerInterval
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = defaultCleanerStatementTimeout
	}
	if c.Backoff == 0 {
		c.Backoff = defaultCleanerBackoff
	}
	if c.MaxTimeouts == 0 {
		c.MaxTimeouts = defaultCleanerMaxTimeouts
	}
	if c.PartitionsAhead == 0 {
		c.PartitionsAhead = defaultPartitionsAhead
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = defaultPartitionLockTimeout
	}
	if c.LockRetries == 0 {
		c.LockRetries = defaultPartitionLockRetries
	}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy (so a config with only DB set is valid).
func (c CleanerConfig) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c CleanerConfig) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("DB: required")
	case c.BatchSize < 1:
		return errors.New("BatchSize: must be positive")
	case c.Interval < 0, c.StatementTimeout < 0, c.Backoff < 0, c.LockTimeout < 0:
		return negativeField(c.Interval, c.StatementTimeout, c.Backoff, c.LockTimeout)
	case c.MaxTimeouts < 1 || c.LockRetries < 1:
		return errors.New("MaxTimeouts, LockRetries: must be positive")
	case c.PartitionsAhead < 0:
		return errors.New("PartitionsAhead: must not be negative")
	case c.DeleteNonV7 && c.Layout == LayoutPartitioned:
		return errors.New("DeleteNonV7: the partitioned layout holds no non-v7 ids")
	}
	return c.TableConfig.validate()
}

// Result reports one pass of the cleaner ([Cleaner.RunOnce]), or what a pass
// would do ([Cleaner.Plan]).
type Result struct {
	// Skipped is true when another instance held the cleaner's lock: this
	// pass did nothing.
	Skipped bool
	// Deleted rows (batched DELETEs; rows in dropped partitions are not counted).
	Deleted int64
	// LeasesDeleted: lease mode's leases that expired more than a retention
	// before the pass (their events were never delivered again). A live
	// lease, or one expired less than a retention ago, is never deleted.
	LeasesDeleted int64
	// Batches run, and Timeouts: batches that hit the statement timeout.
	Batches, Timeouts int
	// PartitionsCreated, PartitionsDropped and PartitionsKept name the
	// partitions the pass created (ahead of today, or for the rows of a day
	// found in the DEFAULT partition), dropped (wholly older than the
	// retention), and kept although old enough to drop because a young
	// group (see YoungGroups) holds claims in them, in the order the pass
	// met them. Partitioned layout only.
	PartitionsCreated, PartitionsDropped, PartitionsKept []string
	// RowsMoved from the DEFAULT partition into a new daily partition
	// (partitioned layout only).
	RowsMoved int64
	// Retention is the retention the pass applied: the recorded one, or
	// for 2 × RetentionRefreshInterval after a shortening the previous one.
	Retention time.Duration
	// YoungGroups are the consumer groups first seen less than a retention
	// ago when the pass started: their claims are kept whatever the event's
	// age, because their stale guard lets old events through (none of their
	// claims can have been cleaned yet). Each DELETE and each partition drop
	// reads the registry again in its own statement, so a group registering
	// during the pass keeps its claims too.
	YoungGroups []string
	// Now is the database's clock at the start of the pass (or
	// CleanerConfig.NowFunc's time): the cutoff is Now minus Retention.
	Now time.Time
	// ClockSkew is how far this host's clock is ahead of the database's
	// (negative: behind), measured at the start of the pass; zero when
	// CleanerConfig.NowFunc is set. The Cleaner does not use it: it is
	// reported (and logged above a minute) because consumers' StaleMargin
	// must cover their own hosts' skew.
	ClockSkew time.Duration
	// Duration of the pass.
	Duration time.Duration
}

// changed reports whether the pass deleted, moved, created or dropped
// anything.
func (r Result) changed() bool {
	return r.Deleted+r.RowsMoved+r.LeasesDeleted > 0 || len(r.PartitionsCreated)+len(r.PartitionsDropped) > 0
}

// Cleaner enforces the retention of a processed_event table. In the plain
// layout it deletes rows older than the retention in bounded batches, each
// in its own short transaction: UUIDv7 rows by an event_id range through the
// primary key (the cutoff time gives the boundary uuid), non-v7 rows by
// processed_at when DeleteNonV7 is set. In the partitioned layout it creates
// the daily partitions ahead, moves rows out of the DEFAULT partition into a
// new partition covering them, detaches and drops partitions wholly older
// than the retention, and deletes old rows left in the DEFAULT partition.
//
// Only one instance works at a time: a pass starts by taking a session
// advisory lock (pg_try_advisory_lock) and is skipped when another instance
// holds it. Run it in every replica of a service or from cron ([Cleaner.RunOnce]).
// [Cleaner.Plan] reports what a pass would do and changes nothing.
type Cleaner struct {
	cfg     CleanerConfig
	logger  watermill.LoggerAdapter
	table   string // quoted schema.table
	lockKey string
	// plan is set on the copy of the Cleaner that [Cleaner.Plan] runs: the
	// pass reads, counts and names, and writes nothing.
	plan bool

	// hook, when set (tests), runs at each step of a pass with the pass's
	// backend pid and, for stepBatch, the batch number: the interleaving
	// tests pause the pass there.
	hook func(s step, pid uint32, n int)
	// hostNow is this host's clock, read only to report Result.ClockSkew.
	hostNow func() time.Time
}

// step is a point of a pass where the interleaving tests pause it.
type step int

const (
	// stepStart: before the pass reads the clock, the retention and the groups.
	stepStart step = iota
	// stepBatch: before each delete batch (n counts the batches done).
	stepBatch
	// stepDrop: before an old partition is locked, checked and dropped.
	stepDrop
)

func (c *Cleaner) at(s step, conn *pgx.Conn, n int) {
	if c.hook != nil {
		c.hook(s, conn.PgConn().PID(), n)
	}
}

// NewCleaner returns a Cleaner. It does not touch the database.
func NewCleaner(cfg CleanerConfig, logger watermill.LoggerAdapter) (*Cleaner, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("cleaner: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Cleaner{
		cfg:     cfg,
		logger:  logger.With(watermill.LogFields{"table": cfg.Schema + "." + cfg.Table, "layout": cfg.Layout.String()}),
		table:   ident.Quote(cfg.Schema, cfg.Table),
		lockKey: "watermill-idempotency/retention/" + cfg.Schema + "." + cfg.Table,
		hostNow: time.Now,
	}, nil
}

// Run runs a pass now and then every Interval until ctx is done; it returns
// nil when ctx is cancelled. A failed pass is logged and retried at the next
// interval.
func (c *Cleaner) Run(ctx context.Context) error {
	for {
		res, err := c.RunOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			c.logger.Error("Retention pass failed", err, nil)
		case res.changed():
			c.logger.Info("Retention pass done", res.logFields())
		case !res.Skipped:
			c.logger.Debug("Retention pass done, nothing to do", res.logFields())
		}
		if wait.Sleep(ctx, c.cfg.Interval) != nil {
			return nil
		}
	}
}

// RunOnce runs one pass and returns what it did. It returns promptly when ctx
// is cancelled (the running batch is cancelled and rolled back), with the
// result so far and ctx's error.
func (c *Cleaner) RunOnce(ctx context.Context) (res Result, err error) {
	start := time.Now()
	defer func() { res.Duration = time.Since(start) }()

	pc, err := c.cfg.DB.Acquire(ctx)
	if err != nil {
		return res, fmt.Errorf("cleaner: acquire connection: %w", err)
	}
	conn := pc.Conn()
	if c.plan {
		// It only reads: no election, so it never makes a real pass skip.
		defer pc.Release()
		return c.pass(ctx, conn, res)
	}
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtextextended($1, 0))", c.lockKey).Scan(&locked); err != nil {
		pc.Release()
		return res, fmt.Errorf("cleaner: advisory lock: %w", err)
	}
	if !locked {
		pc.Release()
		c.logger.Debug("Retention pass skipped: another instance holds the lock", nil)
		res.Skipped = true
		return res, nil
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", c.lockKey); uerr != nil {
			// The lock must not outlive the pass: close the session.
			_ = conn.Close(uctx)
		}
		pc.Release()
	}()
	return c.pass(ctx, conn, res)
}

// Plan reports what a pass of [Cleaner.RunOnce] would do and changes
// nothing: it counts the rows a pass would delete (walking the same ranges in
// the same batches, in read-only transactions), the rows it would move and
// the expired leases it would delete, and names the partitions it would
// create, drop or keep; it deletes, creates, moves, drops and records nothing
// (not even the cleanup horizon). It takes no lock either, so it never makes
// another instance skip a pass, and its counts are those of the moment it
// ran. It may run while [Cleaner.Run] runs.
func (c *Cleaner) Plan(ctx context.Context) (Result, error) {
	p := *c
	p.plan = true
	return p.RunOnce(ctx)
}

// pass runs one pass on conn (holding the cleaner's lock unless planning).
func (c *Cleaner) pass(ctx context.Context, conn *pgx.Conn, res Result) (Result, error) {
	var kind string
	if err := conn.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", c.table).Scan(&kind); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return res, fmt.Errorf("cleaner: %w: %s (run Migrate)", ErrTableMissing, c.table)
		}
		return res, fmt.Errorf("cleaner: %w", err)
	}
	partitioned := kind == "p"
	if partitioned != (c.cfg.Layout == LayoutPartitioned) {
		return res, fmt.Errorf("%w: %s is %s, configured %s", ErrLayoutMismatch, c.table, map[bool]string{true: "partitioned", false: "plain"}[partitioned], c.cfg.Layout)
	}

	c.at(stepStart, conn, 0)
	now, err := c.clock(ctx, conn, &res)
	if err != nil {
		return res, err
	}
	retention, young, err := c.retention(ctx, conn, now)
	if err != nil {
		return res, err
	}
	res.Retention, res.YoungGroups = retention, young
	cutoff := now.Add(-retention)
	boundary := partition.Floor(cutoff)
	if partitioned {
		var movedFrom uuid.UUID
		movedFrom, err = c.maintainPartitions(ctx, conn, now, cutoff, &res)
		if err == nil {
			// Old rows left in the DEFAULT partition (far past ids). A plan
			// moved nothing: rows of the cutoff's day that a real pass
			// would have moved into the day's new partition are not deleted.
			if c.plan && movedFrom != uuid.Nil && bytes.Compare(movedFrom[:], boundary[:]) < 0 {
				boundary = movedFrom
			}
			err = c.deleteV7(ctx, conn, ident.Quote(c.cfg.Schema, partition.DefaultName(c.cfg.Table)), boundary, cutoff, &res)
		}
	} else {
		err = c.deleteV7(ctx, conn, c.table, boundary, cutoff, &res)
		if err == nil && c.cfg.DeleteNonV7 {
			err = c.deleteNonV7(ctx, conn, cutoff, &res)
		}
	}
	if err == nil {
		res.LeasesDeleted, err = c.sweepLeases(ctx, conn, cutoff)
	}
	if err != nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	return res, err
}

// clock returns the time the pass computes with: the database's clock
// (now() of a statement of its own), or NowFunc's time when set. It records
// in res how far this host's clock is off the database's.
func (c *Cleaner) clock(ctx context.Context, conn *pgx.Conn, res *Result) (time.Time, error) {
	if c.cfg.NowFunc != nil {
		res.Now = c.cfg.NowFunc()
		return res.Now, nil
	}
	before := c.hostNow()
	if err := conn.QueryRow(ctx, "SELECT now()").Scan(&res.Now); err != nil {
		return time.Time{}, fmt.Errorf("cleaner: read the database's clock: %w", err)
	}
	after := c.hostNow()
	res.ClockSkew = before.Add(after.Sub(before) / 2).Sub(res.Now).Round(time.Millisecond)
	if res.ClockSkew > RetentionRefreshInterval || res.ClockSkew < -RetentionRefreshInterval {
		c.logger.Info("This host's clock is off the database's: the Cleaner uses the database's clock, but consumers' StaleMargin must cover their own hosts' skew", watermill.LogFields{
			"host_ahead_by": res.ClockSkew.String(),
		})
	}
	return res.Now, nil
}

// retention returns the retention this pass applies and the groups first
// seen less than that long ago (informational: each delete reads the
// registry again), and records the
// pass's cutoff as the table's cleanup horizon before anything is deleted.
// It refuses ([ErrRetentionMismatch]) a configured retention that differs
// from the recorded one. After a shortening (idemctl retention set) it applies the
// previous, longer retention until every running consumer has re-read the
// new one (2 × [RetentionRefreshInterval]).
func (c *Cleaner) retention(ctx context.Context, conn *pgx.Conn, now time.Time) (time.Duration, []string, error) {
	s, err := readSetting(ctx, conn, c.cfg.TableConfig)
	if err == nil {
		err = checkRetention(s, c.cfg.TableConfig)
	}
	if err != nil {
		return 0, nil, fmt.Errorf("cleaner: %w", err)
	}
	retention := s.Retention
	if effective := s.UpdatedAt.Add(2 * RetentionRefreshInterval); s.Previous > retention && now.Before(effective) {
		c.logger.Info("Retention was shortened: applying the previous one until every consumer has re-read it", watermill.LogFields{
			"retention": s.Retention.String(), "previous_retention": s.Previous.String(), "effective_from": effective,
		})
		retention = s.Previous
	}
	gs, err := groups(ctx, conn, c.cfg.TableConfig)
	if err != nil {
		return 0, nil, fmt.Errorf("cleaner: %w", err)
	}
	young := []string{}
	for _, g := range gs {
		if g.Young(now, retention) {
			young = append(young, g.Name)
		}
	}
	if c.plan {
		return retention, young, nil
	}
	// Consumers read it (the stale rule, CheckStale): after a lengthening, the
	// claims of events before it stay gone, and the guard keeps refusing them.
	if _, err := conn.Exec(ctx, "UPDATE "+companion(c.cfg.TableConfig, dedupsql.SettingSuffix)+
		" SET cleaned_before = greatest(coalesce(cleaned_before, '-infinity'), $1)", now.Add(-retention)); err != nil {
		return 0, nil, fmt.Errorf("cleaner: record cleanup horizon: %w", err)
	}
	return retention, young, nil
}

// sweepLeases deletes the leases that expired before cutoff; a plan counts
// them.
func (c *Cleaner) sweepLeases(ctx context.Context, conn *pgx.Conn, cutoff time.Time) (int64, error) {
	l := ident.Quote(c.cfg.Schema, c.cfg.Table+"_lease")
	if c.plan {
		var n int64
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+l+" WHERE expires_at < $1", cutoff).Scan(&n); err != nil {
			return 0, fmt.Errorf("cleaner: count long-expired leases: %w", err)
		}
		return n, nil
	}
	tag, err := conn.Exec(ctx, "DELETE FROM "+l+" WHERE expires_at < $1", cutoff)
	if err != nil {
		return 0, fmt.Errorf("cleaner: delete long-expired leases: %w", err)
	}
	return tag.RowsAffected(), nil
}

func (r Result) logFields() watermill.LogFields {
	return watermill.LogFields{
		"deleted": r.Deleted, "leases_deleted": r.LeasesDeleted, "batches": r.Batches, "timeouts": r.Timeouts,
		"partitions_created": len(r.PartitionsCreated), "partitions_dropped": len(r.PartitionsDropped),
		"rows_moved": r.RowsMoved, "partitions_kept": len(r.PartitionsKept), "duration": r.Duration.String(),
	}
}

// jitter returns d scaled by a random factor in [0.5, 1.5).
func cleanerJitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.5 + rand.Float64()))
}

// negativeField names the first negative of Interval, StatementTimeout,
// Backoff and LockTimeout.
func negativeField(interval, statementTimeout, backoff, lockTimeout time.Duration) error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Interval", interval}, {"StatementTimeout", statementTimeout}, {"Backoff", backoff}, {"LockTimeout", lockTimeout}} {
		if f.d < 0 {
			return fmt.Errorf("%s: must not be negative", f.name)
		}
	}
	return nil
}
