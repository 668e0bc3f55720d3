package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Companion tables of a processed_event table (migration 002).
const (
	settingSuffix = "_setting"
	groupSuffix   = "_group"
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

// Young reports whether the group was first seen less than retention
// before now: none of its claims can have been cleaned yet, and the
// Cleaner keeps all of them.
func (g Group) Young(now time.Time, retention time.Duration) bool {
	return g.FirstSeen.After(now.Add(-retention))
}

func companion(cfg TableConfig, suffix string) string {
	return ident.Quote(cfg.Schema, cfg.Table+suffix)
}

// withDefaults applies and checks cfg's defaults for the functions that take
// a TableConfig.
func withDefaults(cfg TableConfig) (TableConfig, error) {
	cfg.setDefaults()
	return cfg, cfg.validate()
}

// setting is the table's recorded retention state (<table>_setting).
type setting struct {
	retention, previous time.Duration // previous: 0 when never changed
	updatedAt           time.Time
	cleanedBefore       time.Time // zero: never cleaned
}

func readSetting(ctx context.Context, db migrate.DBTX, cfg TableConfig) (setting, error) {
	var (
		s             setting
		us, prevUS    *int64
		cleanedBefore pgtype.Timestamptz
	)
	err := db.QueryRow(ctx, "SELECT (extract(epoch FROM retention) * 1000000)::bigint, (extract(epoch FROM previous_retention) * 1000000)::bigint, updated_at, cleaned_before FROM "+
		companion(cfg, settingSuffix)).Scan(&us, &prevUS, &s.updatedAt, &cleanedBefore)
	if err != nil {
		return setting{}, fmt.Errorf("read retention of %s: %w", ident.Quote(cfg.Schema, cfg.Table), notMigrated(err))
	}
	s.retention = time.Duration(*us) * time.Microsecond
	if prevUS != nil {
		s.previous = time.Duration(*prevUS) * time.Microsecond
	}
	if cleanedBefore.Valid && cleanedBefore.InfinityModifier == pgtype.Finite {
		s.cleanedBefore = cleanedBefore.Time
	}
	return s, nil
}

// check refuses a configured retention that differs from the recorded one.
func (s setting) check(cfg TableConfig) error {
	if cfg.Retention != 0 && cfg.Retention != s.retention {
		return fmt.Errorf("%w: %s records %s, configured %s (leave TableConfig.Retention zero to use the recorded value, or change it for every component with SetRetention)",
			ErrRetentionMismatch, ident.Quote(cfg.Schema, cfg.Table), s.retention, cfg.Retention)
	}
	return nil
}

// RecordedRetention returns the retention recorded with the table.
func RecordedRetention(ctx context.Context, db migrate.DBTX, cfg TableConfig) (time.Duration, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return 0, err
	}
	s, err := readSetting(ctx, db, cfg)
	return s.retention, err
}

// effectiveRetention returns the recorded retention, refusing a configured
// one that differs.
func effectiveRetention(ctx context.Context, db migrate.DBTX, cfg TableConfig) (time.Duration, error) {
	s, err := readSetting(ctx, db, cfg)
	if err != nil {
		return 0, err
	}
	return s.retention, s.check(cfg)
}

// SetRetention changes the retention recorded with the table, for every
// component: running consumers re-read it within [RetentionRefreshInterval].
//
//   - Lengthening takes effect at once. Claims the Cleaner already deleted
//     under the shorter retention do not come back: the table records the
//     highest cutoff the Cleaner applied, and the stale guard keeps refusing
//     events created before it.
//   - Shortening takes effect for the Cleaner only 2 ×
//     RetentionRefreshInterval later (it keeps the previous, longer value
//     until then), so that no running consumer still guards with the longer
//     value while the Cleaner deletes at the shorter one.
func SetRetention(ctx context.Context, db migrate.DBTX, cfg TableConfig, retention time.Duration) error {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return err
	}
	if retention <= 0 {
		return errors.New("retention: must be positive")
	}
	// previous_retention is what the Cleaner applies until every consumer has
	// re-read the change: within that window of an earlier change, keep the
	// longest value some consumer may still hold (30 → 7 → 1 days quickly
	// keeps 30).
	_, err = db.Exec(ctx, "UPDATE "+companion(cfg, settingSuffix)+
		" SET previous_retention = CASE WHEN previous_retention IS NOT NULL AND updated_at > now() - interval '1 microsecond' * $2"+
		" THEN greatest(previous_retention, retention) ELSE retention END,"+
		" retention = interval '1 microsecond' * $1, updated_at = now()", retention.Microseconds(), (2 * RetentionRefreshInterval).Microseconds())
	if err != nil {
		return fmt.Errorf("set retention of %s: %w", ident.Quote(cfg.Schema, cfg.Table), notMigrated(err))
	}
	return nil
}

// groupFirstSeen reads when the group was first seen (zero: before the
// registry existed); the group must be registered.
func (d *Deduplicator) groupFirstSeen(ctx context.Context, db migrate.DBTX) (time.Time, error) {
	var first pgtype.Timestamptz
	err := db.QueryRow(ctx, "SELECT first_seen_at FROM "+companion(d.cfg.TableConfig, groupSuffix)+" WHERE consumer_group = $1", d.cfg.ConsumerGroup).Scan(&first)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("%w: %q (call Register first)", ErrGroupNotFound, d.cfg.ConsumerGroup)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("read consumer group %q: %w", d.cfg.ConsumerGroup, notMigrated(err))
	}
	if first.Valid && first.InfinityModifier == pgtype.Finite {
		return first.Time, nil
	}
	return time.Time{}, nil
}

const groupColumns = "consumer_group, first_seen_at, idempotency_namespace, started_at"

func scanGroup(row pgx.Row) (Group, error) {
	var (
		g     Group
		first pgtype.Timestamptz
	)
	if err := row.Scan(&g.Name, &first, &g.IdempotencyNamespace, &g.StartedAt); err != nil {
		return Group{}, err
	}
	if first.Valid && first.InfinityModifier == pgtype.Finite {
		g.FirstSeen = first.Time
	} // -infinity: the zero time (before every retention)
	return g, nil
}

// Groups returns the consumer groups registered with the table, by name.
func Groups(ctx context.Context, db migrate.DBTX, cfg TableConfig) ([]Group, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	return groups(ctx, db, cfg)
}

func groups(ctx context.Context, db migrate.DBTX, cfg TableConfig) ([]Group, error) {
	rows, err := db.Query(ctx, "SELECT "+groupColumns+" FROM "+companion(cfg, groupSuffix)+" ORDER BY consumer_group")
	if err != nil {
		return nil, fmt.Errorf("read consumer groups of %s: %w", ident.Quote(cfg.Schema, cfg.Table), notMigrated(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Group, error) { return scanGroup(r) })
	if err != nil {
		return nil, fmt.Errorf("read consumer groups of %s: %w", ident.Quote(cfg.Schema, cfg.Table), err)
	}
	return out, nil
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
	g, err := scanGroup(db.QueryRow(ctx, "INSERT INTO "+companion(d.cfg.TableConfig, groupSuffix)+
		" (consumer_group, idempotency_namespace) VALUES ($1, $2)"+
		" ON CONFLICT (consumer_group) DO UPDATE SET started_at = now()"+
		" RETURNING "+groupColumns, d.cfg.ConsumerGroup, ns))
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

// RenameGroup gives consumer group from's claims and registration to the
// new name to, in one transaction: the claims are copied (so every event
// from applied stays applied for to), and to takes from's first-seen time
// and Idempotency-Key namespace, so the keys of downstream calls do not
// change and a provider recognises a call repeated after the rename. from's
// claims and registration are kept until [ForgetGroup] removes them. It
// returns the new group as recorded (first seen and Idempotency-Key
// namespace are the old group's) and the number of claims copied.
//
// Run it with the consumers of both names stopped, then move the Kafka
// offsets with Kafka's tooling and start the consumers under the new name.
// It returns [ErrGroupNotFound] when from is not registered and
// [ErrGroupExists] when to is registered or holds claims.
func RenameGroup(ctx context.Context, db migrate.Beginner, cfg TableConfig, from, to string) (renamed Group, claimsCopied int64, err error) {
	cfg, err = withDefaults(cfg)
	if err != nil {
		return Group{}, 0, err
	}
	if from == "" || to == "" || from == to {
		return Group{}, 0, errors.New("rename group: from and to must be two different, non-empty names")
	}
	if err := ValidateGroupName("from", from); err != nil {
		return Group{}, 0, fmt.Errorf("rename group: %w", err)
	}
	if err := ValidateGroupName("to", to); err != nil {
		return Group{}, 0, fmt.Errorf("rename group: %w", err)
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		grp := companion(cfg, groupSuffix)
		// Serialise with registrations and other renames of these names.
		if _, err := tx.Exec(ctx, "LOCK TABLE "+grp+" IN SHARE ROW EXCLUSIVE MODE"); err != nil {
			return notMigrated(err)
		}
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+grp+" WHERE consumer_group = $1) OR EXISTS (SELECT 1 FROM "+
			ident.Quote(cfg.Schema, cfg.Table)+" WHERE consumer_group = $1)", to).Scan(&exists); err != nil {
			return err
		}
		if exists {
			return fmt.Errorf("%w: %q", ErrGroupExists, to)
		}
		g, err := scanGroup(tx.QueryRow(ctx, "INSERT INTO "+grp+" (consumer_group, first_seen_at, idempotency_namespace)"+
			" SELECT $2, first_seen_at, idempotency_namespace FROM "+grp+" WHERE consumer_group = $1"+
			" RETURNING "+groupColumns, from, to))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", ErrGroupNotFound, from)
		}
		if err != nil {
			return err
		}
		renamed = g
		tag, err := tx.Exec(ctx, "INSERT INTO "+ident.Quote(cfg.Schema, cfg.Table)+" (event_id, consumer_group, processed_at)"+
			" SELECT event_id, $2, processed_at FROM "+ident.Quote(cfg.Schema, cfg.Table)+" WHERE consumer_group = $1 ON CONFLICT DO NOTHING", from, to)
		if err != nil {
			return err
		}
		claimsCopied = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return Group{}, 0, fmt.Errorf("rename group %q to %q: %w", from, to, err)
	}
	return renamed, claimsCopied, nil
}

// ForgetGroup deletes a consumer group's claims and registration, in one
// transaction, and returns the number of claims deleted. Use it for a group
// that no longer consumes (after [RenameGroup], or a decommissioned
// service): its claims are dead weight. A consumer of that group
// started afterwards is new: it applies every event it reads again.
func ForgetGroup(ctx context.Context, db migrate.Beginner, cfg TableConfig, group string) (int64, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return 0, err
	}
	if err := ValidateGroupName("group", group); err != nil {
		return 0, fmt.Errorf("forget group: %w", err)
	}
	var n int64
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, "DELETE FROM "+companion(cfg, groupSuffix)+" WHERE consumer_group = $1", group)
		if err != nil {
			return notMigrated(err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: %q", ErrGroupNotFound, group)
		}
		tag, err = tx.Exec(ctx, "DELETE FROM "+ident.Quote(cfg.Schema, cfg.Table)+" WHERE consumer_group = $1", group)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("forget group %q: %w", group, err)
	}
	return n, nil
}

// notMigrated turns "relation does not exist" (SQLSTATE 42P01) into a
// [*migrate.TableError] wrapping [ErrTableMissing] that names the missing table
// (the processed_event table or one of its companions): a table the library
// needs is missing (migrate [MigrationLine] up).
func notMigrated(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
		// The message is `relation "schema.table" does not exist`, the name
		// as the query wrote it.
		table := pgErr.Message
		if _, rest, ok := strings.Cut(pgErr.Message, `"`); ok {
			if name, _, ok := strings.Cut(rest, `"`); ok {
				table = name
			}
		}
		return &migrate.TableError{Component: "deduplicator", Table: table, Problem: "does not exist", Fix: fixMigrate, Err: ErrTableMissing}
	}
	return err
}
