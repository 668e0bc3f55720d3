package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Group is a consumer group registered with a table, as recorded.
type Group struct {
	// Name is the consumer group (the second half of the dedup key).
	Name string
	// FirstSeen is when the group's consumers first started on this table
	// (-infinity, i.e. the zero time, for groups that held claims before the
	// registry existed). A group first seen less than a retention ago cannot
	// have lost a claim to the Cleaner: its stale guard lets old events
	// through, and the Cleaner keeps its claims until it is older.
	FirstSeen time.Time
	// IdempotencyNamespace is mixed into named Idempotency-Keys instead of
	// the group's name, so a renamed group keeps its keys.
	IdempotencyNamespace string
	// StartedAt is when a consumer of the group last started.
	StartedAt time.Time
}

func companion(cfg TableConfig, suffix string) string {
	return dedupsql.Companion(cfg.Schema, cfg.Table, suffix)
}

// readSetting reads the table's recorded retention state; a missing table is
// a [*migrate.TableError] wrapping [ErrTableMissing].
func readSetting(ctx context.Context, db migrate.DBTX, cfg TableConfig) (dedupsql.Setting, error) {
	st, err := dedupsql.ReadSetting(ctx, db, cfg.Schema, cfg.Table)
	if err != nil {
		return dedupsql.Setting{}, fmt.Errorf("read retention of %s: %w", ident.Quote(cfg.Schema, cfg.Table), notMigrated(err))
	}
	return st, nil
}

// checkRetention refuses a configured retention that differs from the
// recorded one.
func checkRetention(s dedupsql.Setting, cfg TableConfig) error {
	if cfg.Retention != 0 && cfg.Retention != s.Retention {
		return fmt.Errorf("%w: %s records %s, configured %s (leave TableConfig.Retention zero to use the recorded value, or change it for every component with idemctl retention set)",
			ErrRetentionMismatch, ident.Quote(cfg.Schema, cfg.Table), s.Retention, cfg.Retention)
	}
	return nil
}

// effectiveRetention returns the recorded retention, refusing a configured
// one that differs.
func effectiveRetention(ctx context.Context, db migrate.DBTX, cfg TableConfig) (time.Duration, error) {
	s, err := readSetting(ctx, db, cfg)
	if err != nil {
		return 0, err
	}
	return s.Retention, checkRetention(s, cfg)
}

// groupFirstSeen reads when the group was first seen (zero: before the
// registry existed); the group must be registered.
func (d *Deduplicator) groupFirstSeen(ctx context.Context, db migrate.DBTX) (time.Time, error) {
	var first pgtype.Timestamptz
	err := db.QueryRow(ctx, "SELECT first_seen_at FROM "+companion(d.cfg.TableConfig, dedupsql.GroupSuffix)+" WHERE consumer_group = $1", d.cfg.ConsumerGroup).Scan(&first)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("%w: %q (call Register first)", dedupsql.ErrGroupNotFound, d.cfg.ConsumerGroup)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("read consumer group %q: %w", d.cfg.ConsumerGroup, notMigrated(err))
	}
	if first.Valid && first.InfinityModifier == pgtype.Finite {
		return first.Time, nil
	}
	return time.Time{}, nil
}

func scanGroup(row pgx.Row) (Group, error) {
	g, err := dedupsql.ScanGroup(row)
	return Group(g), err
}

// groups returns the table's registered groups.
func groups(ctx context.Context, db migrate.DBTX, cfg TableConfig) ([]dedupsql.Group, error) {
	gs, err := dedupsql.Groups(ctx, db, cfg.Schema, cfg.Table)
	return gs, notMigrated(err)
}

// Register records that a consumer of the deduplicator's group starts, and
// returns the group as recorded: when it was first seen and its
// Idempotency-Key namespace. The middleware calls it at start-up; call it
// at start-up when you claim through a Deduplicator yourself, so that the
// Cleaner and [Deduplicator.CheckStale] know the group. It reads the
// table's retention for CheckStale, and refuses a [Config.StaleMargin] not
// shorter than it.
//
// namespace is the Idempotency-Key namespace the consumer is configured
// with; "" takes the recorded one (the group's name at its first start). A
// different non-empty namespace is refused with [ErrNamespaceMismatch]. A
// configured TableConfig.Retention that differs from the recorded one is
// refused with [ErrRetentionMismatch].
func (d *Deduplicator) Register(ctx context.Context, db migrate.DBTX, namespace string) (Group, error) {
	if _, err := effectiveRetention(ctx, db, d.cfg.TableConfig); err != nil {
		return Group{}, err
	}
	ns := namespace
	if ns == "" {
		ns = d.cfg.ConsumerGroup
	}
	g, err := scanGroup(db.QueryRow(ctx, "INSERT INTO "+companion(d.cfg.TableConfig, dedupsql.GroupSuffix)+
		" (consumer_group, idempotency_namespace) VALUES ($1, $2)"+
		" ON CONFLICT (consumer_group) DO UPDATE SET started_at = now()"+
		" RETURNING "+dedupsql.GroupColumns, d.cfg.ConsumerGroup, ns))
	if err != nil {
		return Group{}, fmt.Errorf("register consumer group %q: %w", d.cfg.ConsumerGroup, groupNameRefused("ConsumerGroup", d.cfg.ConsumerGroup, notMigrated(err)))
	}
	if namespace != "" && g.IdempotencyNamespace != namespace {
		return Group{}, fmt.Errorf("%w: group %q records %q, configured %q (a renamed group keeps its namespace: leave it empty)",
			ErrNamespaceMismatch, d.cfg.ConsumerGroup, g.IdempotencyNamespace, namespace)
	}
	if err := d.loadHorizon(ctx, db); err != nil {
		return Group{}, err
	}
	return g, nil
}

// notMigrated turns "relation does not exist" (SQLSTATE 42P01) into a
// [*migrate.TableError] wrapping [ErrTableMissing] that names the missing table
// (the processed_event table or one of its companions): a table the library
// needs is missing (migrate [MigrationLine] up).
func notMigrated(err error) error {
	if table, ok := pgerr.UndefinedTable(err); ok {
		return &migrate.TableError{Component: "deduplicator", Table: table, Problem: "does not exist", Fix: fixMigrate, Err: ErrTableMissing}
	}
	return err
}
