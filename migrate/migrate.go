package migrate

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
)

// Beginner begins a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx (then
// a savepoint) fit.
type Beginner = dbx.Beginner

// DBTX runs statements: *pgxpool.Pool, *pgx.Conn and pgx.Tx fit.
type DBTX = dbx.Querier

// Direction is the way [Migrator.Migrate] goes.
type Direction string

// The directions.
const (
	DirectionUp   Direction = "up"
	DirectionDown Direction = "down"
)

var (
	// ErrUnknownVersion is returned going down when idem_schema_migration
	// records a version of a line that the line does not have (a version of
	// another layout, or of a newer release of the library): reverting
	// around it could drop what it relies on. Migrate down with the config
	// or the release that applied it.
	ErrUnknownVersion = errors.New("migrate: idem_schema_migration records a version the migrator does not know")
	// ErrMigrationsPending is the reason of a [*TableError] when a table
	// exists but versions of its line are not recorded as applied.
	ErrMigrationsPending = errors.New("migrate: migrations are pending")
)

// TableError is a component's table that cannot be relied on: missing,
// shaped otherwise than its line's migrations make it, or with versions
// pending. deduplicator.Check, (*outbox.Outbox).Check and the components'
// start-up checks return it. Its message names the table, the problem and
// the fix in one line; Unwrap returns the reason: [ErrMigrationsPending] or
// a sentinel of the component (deduplicator.ErrTableMissing, ErrTableKey,
// ErrTableColumns, ErrLayoutMismatch; outbox.ErrTopicNotMigrated,
// ErrTableShape).
type TableError struct {
	// Component names what checked the table: "deduplicator",
	// "outbox: topic <topic>" or "retrytopic".
	Component string
	// Table is the schema-qualified table.
	Table string
	// Problem says what is wrong and what it would do; Fix what to do
	// about it.
	Problem, Fix string
	// Err is the reason.
	Err error
}

func (e *TableError) Error() string {
	return e.Component + ": table " + e.Table + ": " + e.Problem + "; fix: " + e.Fix
}

// Unwrap returns the reason.
func (e *TableError) Unwrap() error { return e.Err }

// Line is the chain of versioned migrations that one component contributes
// to a [Migrator]: deduplicator.MigrationLine (a processed_event table and
// its companions), outbox.MigrationLine (one topic's tables) and
// retrytopic.MigrationLine (the parked-keys table) return one.
type Line struct {
	// Component keys the line's versions in the schema's
	// idem_schema_migration table ("processed_event:<table>",
	// "outbox:<messages table>", "retry_parked_key:<table>"): letters,
	// digits and _:.$- only.
	Component string
	// Schema holds the line's tables and the migration table recording
	// them.
	Schema string
	// Templates hold the line's NNN_name.up.sql and NNN_name.down.sql
	// files at their roots: text/template sources rendered with Data, in
	// which {{ident "a" "b"}} quotes identifiers.
	Templates []fs.FS
	// Data is what the templates see.
	Data any
	// BeforeUpFunc, when set, runs before any version of any line goes up,
	// in a transaction that is rolled back: an error refuses the migration
	// before anything changes (an existing table of the wrong shape).
	BeforeUpFunc func(ctx context.Context, tx pgx.Tx) error
	// VerifyFunc, when set, runs in the transaction of every version going
	// up, after its SQL and before its record: an error rolls the version
	// back. It adopts tables that an unversioned CREATE TABLE IF NOT EXISTS
	// made earlier only when their shape matches.
	VerifyFunc func(ctx context.Context, tx pgx.Tx, version int) error
	// CheckFunc, when set, runs once the line is at its newest version
	// going up, in a transaction that is rolled back: the component's
	// start-up check of its tables.
	CheckFunc func(ctx context.Context, tx pgx.Tx) error
	// Err, when set, is returned by [New]: how a component's MigrationLine
	// reports an invalid config while staying one expression.
	Err error
}

// Migration is one version of one line rendered for its tables, as a file
// for goose or golang-migrate: Up ends by recording the version in the
// schema's idem_schema_migration table (created if missing) and Down by
// deleting that record, as [Migrator.Migrate] does, so that the components'
// start-up checks accept the tables.
type Migration struct {
	// Component is the line's [Line.Component].
	Component string
	Version   int
	Name      string
	Up        string
	Down      string
}

// MigrateOpts narrow [Migrator.Migrate]; nil is the zero value.
type MigrateOpts struct {
	// TargetVersion going up applies the versions up to and including it;
	// going down it reverts the versions above it, newest first, and -1
	// reverts every version (the tables are dropped). When set (> 0) it
	// must be a version of every line of the Migrator. Defaults to 0: up,
	// every version; down, only the newest applied version of each line, so
	// that a down migration never drops more than one step by accident.
	TargetVersion int
}

// MigrateResult is what [Migrator.Migrate] did.
type MigrateResult struct {
	// Direction is the direction it migrated in.
	Direction Direction
	// Versions are the versions it applied (up) or reverted (down), in the
	// order it ran them; empty when there was nothing to do.
	Versions []MigrateVersion
}

// MigrateVersion is one version of one line applied or reverted.
type MigrateVersion struct {
	Component string
	Version   int
	Name      string
	// Duration is how long its transaction took.
	Duration time.Duration
}

// ValidateResult is what [Migrator.Validate] found.
type ValidateResult struct {
	// OK is true when every version of every line is recorded as applied.
	OK bool
	// Pending are the versions not recorded as applied, line by line,
	// oldest first, rendered as [Migrator.Migrations] renders them.
	Pending []Migration
}

// MigrationStatus is one version of one line: applied (with when) or
// pending, or recorded but unknown to the line.
type MigrationStatus struct {
	Component string
	// Version and Name are the line's; for an Unknown version, the recorded
	// ones.
	Version int
	Name    string
	// Applied is true when idem_schema_migration records the version, at
	// AppliedAt.
	Applied   bool
	AppliedAt time.Time
	// Unknown is true for a version recorded for the line that the line
	// does not have (another layout's, a newer release's): a down migration
	// refuses to revert past it ([ErrUnknownVersion]).
	Unknown bool
}

// Migrator creates, upgrades and downgrades the tables of its lines with
// their embedded, versioned migrations, recording each version in the
// idem_schema_migration table of the line's schema. Every version runs in
// its own transaction that takes a per-schema advisory lock, so every
// instance of a service may migrate at start-up. A Migrator is safe for
// concurrent use.
type Migrator struct {
	db     Beginner
	chains []chain
}

// New returns a Migrator of lines on db, a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx (each version then runs in a savepoint of it). db may be nil for a
// Migrator that only renders ([Migrator.Migrations]) or works on the
// caller's transaction (MigrateTx, ValidateTx). New renders every version,
// and refuses a line whose Err is set, whose schema or component is
// invalid, or that has no version.
func New(db Beginner, lines ...Line) (*Migrator, error) {
	m := &Migrator{db: db}
	seen := map[string]bool{}
	for _, l := range lines {
		if l.Err != nil {
			return nil, l.Err
		}
		if err := ident.Validate("schema", l.Schema); err != nil {
			return nil, fmt.Errorf("migrate: line %s: %w", l.Component, err)
		}
		if err := migtable.ValidComponent(l.Component); err != nil {
			return nil, fmt.Errorf("migrate: %w", err)
		}
		key := l.Schema + "." + l.Component
		if seen[key] {
			return nil, fmt.Errorf("migrate: line %s of schema %s given twice", l.Component, l.Schema)
		}
		seen[key] = true
		vs, err := migtable.Load(l.Data, l.Templates...)
		if err != nil {
			return nil, fmt.Errorf("migrate: line %s: %w", l.Component, err)
		}
		if len(vs) == 0 {
			return nil, fmt.Errorf("migrate: line %s has no version", l.Component)
		}
		m.chains = append(m.chains, chain{Line: l, versions: vs})
	}
	return m, nil
}

// Up creates or upgrades the tables of lines to their newest versions:
// New(db, lines...) then Migrate(ctx, DirectionUp, nil), for start-up.
func Up(ctx context.Context, db Beginner, lines ...Line) error {
	m, err := New(db, lines...)
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, DirectionUp, nil)
	return err
}

// Migrate migrates every line in direction (up line by line in the order
// given to [New], down backwards), each version in its own transaction, and
// returns the versions it applied or reverted. opts may be nil: up applies
// every pending version; down reverts only the newest applied version of
// each line (see [MigrateOpts.TargetVersion]).
//
// Going up, the lines' BeforeUpFunc run first and an error there changes
// nothing; once a line is at its newest version its CheckFunc runs. On
// error the result still lists the versions that ran before it: each
// version commits on its own, the failing one is rolled back.
func (m *Migrator) Migrate(ctx context.Context, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	if m.db == nil {
		return &MigrateResult{Direction: direction, Versions: []MigrateVersion{}}, errNoDB
	}
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
	if err := checkTarget(direction, m.chains, opts.TargetVersion); err != nil {
		return res, fmt.Errorf("migrate: %w", err)
	}
	if direction == DirectionDown {
		steps, err := down(ctx, db, m.chains, opts.TargetVersion)
		res.Versions = steps
		if err != nil {
			return res, fmt.Errorf("migrate down: %w", err)
		}
		return res, nil
	}
	for _, c := range m.chains {
		if c.BeforeUpFunc == nil {
			continue
		}
		if err := readTx(ctx, db, func(tx pgx.Tx) error { return c.BeforeUpFunc(ctx, tx) }); err != nil {
			return res, err
		}
	}
	steps, err := up(ctx, db, m.chains, opts.TargetVersion)
	res.Versions = steps
	if err != nil {
		return res, fmt.Errorf("migrate up: %w", err)
	}
	for _, c := range m.chains {
		if c.CheckFunc == nil || (opts.TargetVersion != 0 && opts.TargetVersion < c.newest()) {
			continue
		}
		if err := readTx(ctx, db, func(tx pgx.Tx) error { return c.CheckFunc(ctx, tx) }); err != nil {
			return res, err
		}
	}
	return res, nil
}

// Validate reports the versions not recorded as applied, reading
// idem_schema_migration in a transaction of its own. Run it at start-up
// where another process owns the migrations.
func (m *Migrator) Validate(ctx context.Context) (*ValidateResult, error) {
	if m.db == nil {
		return nil, errNoDB
	}
	var res *ValidateResult
	err := readTx(ctx, m.db, func(tx pgx.Tx) (err error) {
		res, err = m.ValidateTx(ctx, tx)
		return err
	})
	return res, err
}

// ValidateTx is [Migrator.Validate] on the caller's transaction.
func (m *Migrator) ValidateTx(ctx context.Context, tx pgx.Tx) (*ValidateResult, error) {
	res := &ValidateResult{Pending: []Migration{}}
	for _, c := range m.chains {
		versions, err := migtable.Pending(ctx, tx, c.Schema, c.Component, c.versions)
		if err != nil {
			return nil, readError(c, err)
		}
		for _, v := range c.versions {
			if slices.Contains(versions, v.Version) {
				r, err := render(c, v)
				if err != nil {
					return nil, err
				}
				res.Pending = append(res.Pending, r)
			}
		}
	}
	res.OK = len(res.Pending) == 0
	return res, nil
}

// Status lists every version of every line, oldest first, as applied (with
// when) or pending, each line followed by the versions recorded for it that
// it does not have (Unknown). It only reads, in a transaction of its own.
// [Migrator.Validate] is the shorter answer to "is anything pending?".
func (m *Migrator) Status(ctx context.Context) ([]MigrationStatus, error) {
	if m.db == nil {
		return nil, errNoDB
	}
	out := []MigrationStatus{}
	err := readTx(ctx, m.db, func(tx pgx.Tx) error {
		for _, c := range m.chains {
			st, err := status(ctx, tx, c)
			if err != nil {
				return readError(c, err)
			}
			out = append(out, st...)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate: status: %w", err)
	}
	return out, nil
}

// Migrations returns every version of every line, line by line, oldest
// first, rendered for goose or golang-migrate (see [Migration]). It does
// not connect.
func (m *Migrator) Migrations() ([]Migration, error) {
	var out []Migration
	for _, c := range m.chains {
		for _, v := range c.versions {
			r, err := render(c, v)
			if err != nil {
				return nil, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

var errNoDB = errors.New("migrate: the Migrator has no db (New got nil)")

// render adds to v the SQL that records it (Up) and forgets it (Down).
func render(c chain, v migtable.Version) (Migration, error) {
	up, down, err := migtable.RecordSQL(c.Schema, c.Component, v)
	if err != nil {
		return Migration{}, err
	}
	out := Migration{Component: c.Component, Version: v.Version, Name: v.Name}
	out.Up = strings.TrimRight(v.Up, "\n") + "\n\n-- Recorded as applied, for the start-up checks.\n" + up
	if v.Down != "" {
		out.Down = strings.TrimRight(v.Down, "\n") + "\n" + down
	}
	return out, nil
}

// readError names the line and, for a role that may not read the migration
// table, the grant it needs.
func readError(c chain, err error) error {
	if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
		return fmt.Errorf("migrate: %s: cannot read %s.%s (GRANT SELECT on it to this role): %w", c.Component, c.Schema, migtable.Table, err)
	}
	return fmt.Errorf("migrate: %s: %w", c.Component, err)
}
