package deduplicator

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationTemplates holds the raw migration files (NNN_name.up.sql and
// NNN_name.down.sql). They are text/template sources with {{ident ...}}
// placeholders for the schema and table; use [Migrations] to get SQL ready
// for goose or golang-migrate.
var MigrationTemplates fs.FS = mustSub(migrationFiles, "migrations")

func mustSub(fsys fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// component is the name under which this package's migrations are recorded
// in the idem_schema_migration table, followed by ":" and the table name
// (processed_event:processed_event for the defaults; see
// [Migration.Component]).
const component = "processed_event"

// Migration is one version of one component's tables, rendered for its
// schema and names ([Migrations]; outbox.Migrations for the outbox's
// tables): write Up and Down to files for goose or golang-migrate.
type Migration struct {
	// Component is the key of the version's record in idem_schema_migration:
	// "processed_event:" and the table name, or "outbox:" and an outbox
	// topic's messages table name.
	Component string
	Version   int
	Name      string
	Up        string
	Down      string
}

// Beginner begins a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx fit.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Direction is the way a [Migrator] (or an outbox.Migrator) migrates:
// [DirectionUp] or [DirectionDown].
type Direction string

// The directions of [Migrator.Migrate].
const (
	DirectionUp   Direction = "up"
	DirectionDown Direction = "down"
)

// MigrateOpts narrow [Migrator.Migrate] (and outbox.Migrator's); nil is the
// zero value.
type MigrateOpts struct {
	// TargetVersion going up applies the versions up to and including it;
	// going down it reverts the versions above it, newest first, leaving
	// each component at that version, and -1 reverts every version (the
	// tables are dropped). When set (> 0) it must be a version of every
	// component the migrator covers (see [Migrations]). Defaults to 0: up,
	// every version; down, only the newest applied version of each
	// component, so that a down migration never drops more than one step by
	// accident.
	TargetVersion int
}

// MigrateResult is what [Migrator.Migrate] (or an outbox.Migrator) did.
type MigrateResult struct {
	// Direction is the direction it migrated in.
	Direction Direction
	// Versions are the versions it applied (up) or reverted (down), in the
	// order it ran them; empty when there was nothing to do.
	Versions []MigrateVersion
}

// MigrateVersion is one version of one component applied or reverted.
type MigrateVersion struct {
	// Component is the key of the version's record in idem_schema_migration
	// (see [Migration.Component]).
	Component string
	// Version and Name are the migration's (001_processed_event: 1, "processed_event").
	Version int
	Name    string
	// Duration is how long its transaction took.
	Duration time.Duration
}

// ErrUnknownVersion is returned going down (by a [Migrator] or an
// outbox.Migrator) when idem_schema_migration records a version of a
// component that the migrator does not have: version 100 of
// [LayoutPartitioned] under a LayoutPlain config, or a version of a newer
// release of this library. Reverting around it could drop what it relies
// on; migrate down with the config (or the release) that applied it.
var ErrUnknownVersion = errors.New("deduplicator: idem_schema_migration records a version the migrator does not know")

// ValidateResult is what [Migrator.Validate] (or an outbox.Migrator's)
// found.
type ValidateResult struct {
	// OK is true when every migration is recorded as applied.
	OK bool
	// Pending are the migrations not recorded as applied, component by
	// component, oldest first, rendered as [Migrations] (or
	// outbox.Migrations) renders them.
	Pending []Migration
}

// Migrator creates, upgrades and downgrades one processed_event table and
// its companion tables (<table>_setting and <table>_group) with the
// embedded, versioned migrations of its layout, recording each version in
// the schema's idem_schema_migration table under the component
// processed_event:<table>. The outbox's tables have a migrator of the same
// shape and types, on the same engine and migration table
// (outbox.NewMigrator).
//
// Every version runs in its own transaction that takes a per-schema
// advisory lock, so every instance of a service may migrate at start-up.
// A Migrator is safe for concurrent use.
type Migrator struct {
	db   Beginner
	cfg  TableConfig
	migs []migrate.Migration
}

// NewMigrator returns a Migrator of the table described by table (the same
// value the middleware and the [Cleaner] get) on db, a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx (each version then runs in a savepoint of it).
func NewMigrator(db Beginner, table TableConfig) (*Migrator, error) {
	if db == nil {
		return nil, errors.New("deduplicator: NewMigrator: db is nil")
	}
	table.setDefaults()
	if err := table.validate(); err != nil {
		return nil, fmt.Errorf("deduplicator: invalid config: %w", err)
	}
	migs, err := loadMigrations(table)
	if err != nil {
		return nil, err
	}
	return &Migrator{db: db, cfg: table, migs: migs}, nil
}

// Migrate migrates the table in direction, each version in its own
// transaction, and returns the versions it applied or reverted. opts may
// be nil: up applies every pending version; down reverts only the newest
// applied one (set [MigrateOpts.TargetVersion]).
//
// Going up, a table that already exists is verified first: if its key,
// partitioning or columns are not what claims need (the reference recipe's
// PRIMARY KEY (event_id), or partitions on processed_at), Migrate returns a
// [*TableError] and neither changes nor records anything; [ConvertTable]
// converts such a table. Once at the newest version, Migrate runs [Check]
// and returns its error, and refuses a configured retention that differs
// from the recorded one ([ErrRetentionMismatch]).
//
// On error the result still lists the versions that ran before it: each
// version commits on its own, the failing one is rolled back.
func (m *Migrator) Migrate(ctx context.Context, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	return m.migrate(ctx, m.db, direction, opts)
}

// MigrateTx is [Migrator.Migrate] on the caller's transaction: every
// version runs in a savepoint of tx, and nothing is visible to others, or
// kept, until tx commits. The migration lock is held until tx ends.
func (m *Migrator) MigrateTx(ctx context.Context, tx pgx.Tx, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	return m.migrate(ctx, tx, direction, opts)
}

func (m *Migrator) migrate(ctx context.Context, db Beginner, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	if opts == nil {
		opts = &MigrateOpts{}
	}
	res := &MigrateResult{Direction: direction, Versions: []MigrateVersion{}}
	if direction == DirectionUp {
		if err := readTx(ctx, db, func(tx pgx.Tx) error { return checkBeforeMigrate(ctx, tx, m.cfg) }); err != nil {
			return res, err
		}
	}
	line := migrate.Line{Component: componentKey(m.cfg), Migrations: m.migs}
	steps, err := migrate.Migrate(ctx, db, m.cfg.Schema, migrate.Direction(direction), []migrate.Line{line}, migrate.Options{TargetVersion: opts.TargetVersion})
	for _, s := range steps {
		res.Versions = append(res.Versions, MigrateVersion(s))
	}
	if errors.Is(err, migrate.ErrUnknownVersion) {
		return res, fmt.Errorf("%w: %w", ErrUnknownVersion, err)
	}
	if err != nil {
		return res, fmt.Errorf("deduplicator: migrate %s: %w", direction, err)
	}
	if direction != DirectionUp || (opts.TargetVersion != 0 && opts.TargetVersion < m.migs[len(m.migs)-1].Version) {
		return res, nil
	}
	if err := readTx(ctx, db, func(tx pgx.Tx) error { return check(ctx, tx, m.cfg, m.migs) }); err != nil {
		return res, err
	}
	// A new table recorded cfg.Retention; an existing one keeps its own.
	return res, readTx(ctx, db, func(tx pgx.Tx) error {
		_, err := effectiveRetention(ctx, tx, m.cfg)
		return err
	})
}

// Validate reports the migrations not recorded as applied, reading
// idem_schema_migration in a transaction of its own. Run it at start-up
// where another process owns the migrations ([Check] runs it besides
// verifying the table itself).
func (m *Migrator) Validate(ctx context.Context) (*ValidateResult, error) {
	var res *ValidateResult
	err := readTx(ctx, m.db, func(tx pgx.Tx) (err error) {
		res, err = m.ValidateTx(ctx, tx)
		return err
	})
	return res, err
}

// ValidateTx is [Migrator.Validate] on the caller's transaction.
func (m *Migrator) ValidateTx(ctx context.Context, tx pgx.Tx) (*ValidateResult, error) {
	pending, err := pendingMigrations(ctx, tx, m.cfg, m.migs)
	if err != nil {
		return nil, err
	}
	return &ValidateResult{OK: len(pending) == 0, Pending: pending}, nil
}

// pendingMigrations returns the migrations of migs not recorded for cfg's
// table, rendered as Migrations renders them.
func pendingMigrations(ctx context.Context, db migrate.Querier, cfg TableConfig, migs []migrate.Migration) ([]Migration, error) {
	versions, err := migrate.Pending(ctx, db, cfg.Schema, componentKey(cfg), migs)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
			return nil, fmt.Errorf("deduplicator: table %s.%s: cannot read %s.%s (GRANT SELECT on it to this role): %w", cfg.Schema, cfg.Table, cfg.Schema, migrate.Table, err)
		}
		return nil, fmt.Errorf("deduplicator: table %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	pending := make([]Migration, 0, len(versions))
	for _, m := range migs {
		if slices.Contains(versions, m.Version) {
			r, err := render(cfg, m)
			if err != nil {
				return nil, err
			}
			pending = append(pending, r)
		}
	}
	return pending, nil
}

// Migrations returns the schema migrations rendered for cfg's schema and
// table, oldest first; with [LayoutPartitioned] they include
// [PartitionedMigrationTemplates] (version 100 onward). Write each Up/Down
// to files to manage the schema with an external tool instead of a
// [Migrator]; outbox.Migrations renders the outbox's tables the same way.
//
// Each Up ends by recording its version in the schema's
// idem_schema_migration table (created if missing), and each Down by
// deleting that record, as [Migrator.Migrate] does: [Check] (which the
// middleware runs at start-up) refuses a table whose migrations are not
// recorded, and a Migrator applies nothing that is recorded.
func Migrations(cfg TableConfig) ([]Migration, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	migs, err := loadMigrations(cfg)
	if err != nil {
		return nil, err
	}
	out := make([]Migration, len(migs))
	for i, m := range migs {
		if out[i], err = render(cfg, m); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// render adds to m the SQL that records it (Up) and forgets it (Down).
func render(cfg TableConfig, m migrate.Migration) (Migration, error) {
	up, down, err := migrate.RecordSQL(cfg.Schema, componentKey(cfg), m)
	if err != nil {
		return Migration{}, err
	}
	out := Migration{Component: componentKey(cfg), Version: m.Version, Name: m.Name}
	out.Up = strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for deduplicator.Check.\n" + up
	if m.Down != "" {
		out.Down = strings.TrimRight(m.Down, "\n") + "\n" + down
	}
	return out, nil
}

// Migrate creates or upgrades the processed_event table described by cfg
// to the newest version: NewMigrator(db, cfg) then Migrate(ctx,
// DirectionUp, nil), for start-up. Use a [Migrator] to learn which versions
// were applied, to migrate down, or to migrate on your own transaction.
func Migrate(ctx context.Context, db Beginner, cfg TableConfig) error {
	m, err := NewMigrator(db, cfg)
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, DirectionUp, nil)
	return err
}

// readTx runs fn in a transaction (a savepoint when db is a pgx.Tx) that is
// rolled back: fn only reads.
func readTx(ctx context.Context, db Beginner, fn func(tx pgx.Tx) error) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("deduplicator: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return fn(tx)
}
