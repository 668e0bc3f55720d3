package retrytopic

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationTemplates holds the raw migration files of the parked-keys table
// (NNN_name.up.sql, NNN_name.down.sql): text/template sources with {{ident
// ...}} placeholders for the schema and table. [Migrations] renders them.
var MigrationTemplates fs.FS = mustSub(migrationFiles, "migrations")

func mustSub(fsys fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// component is the name the parked-keys migrations are recorded under in
// the library's migration table, with the table name after a colon.
const component = "retry_parked_key"

func componentKey(t ParkedKeysTable) string { return component + ":" + t.Table }

func load(t ParkedKeysTable) ([]migrate.Migration, error) {
	return migrate.Load(MigrationTemplates, struct{ Schema, Table string }{t.Schema, t.Table})
}

func render(t ParkedKeysTable, m migrate.Migration) (deduplicator.Migration, error) {
	up, down, err := migrate.RecordSQL(t.Schema, componentKey(t), m)
	if err != nil {
		return deduplicator.Migration{}, err
	}
	out := deduplicator.Migration{Component: componentKey(t), Version: m.Version, Name: m.Name}
	out.Up = strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for retrytopic.New.\n" + up
	if m.Down != "" {
		out.Down = strings.TrimRight(m.Down, "\n") + "\n" + down
	}
	return out, nil
}

// Migrations returns the parked-keys table's migrations rendered for t,
// oldest first, in deduplicator's Migration type (as outbox.Migrations
// does): write each Up/Down to files for goose or golang-migrate. Each Up
// ends by recording its version in the schema's idem_schema_migration table
// (component retry_parked_key:<table>), and each Down by deleting that
// record, as a [Migrator] does: [New] refuses a table whose versions are
// not recorded.
func Migrations(t ParkedKeysTable) ([]deduplicator.Migration, error) {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return nil, fmt.Errorf("retrytopic: %w", err)
	}
	migs, err := load(t)
	if err != nil {
		return nil, err
	}
	out := make([]deduplicator.Migration, len(migs))
	for i, m := range migs {
		if out[i], err = render(t, m); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Migrator migrates the parked-keys table of [KeyOrder] with the library's
// one migration engine: it has the shape of deduplicator.Migrator and
// outbox.Migrator (and their types), so one tool drives all three.
type Migrator struct {
	db    deduplicator.Beginner
	table ParkedKeysTable
	migs  []migrate.Migration
}

// NewMigrator returns a Migrator of table on db, a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx (each version then runs in a savepoint of it).
func NewMigrator(db deduplicator.Beginner, table ParkedKeysTable) (*Migrator, error) {
	if db == nil {
		return nil, errors.New("retrytopic: NewMigrator: db is nil")
	}
	table.setDefaults()
	if err := table.validate(); err != nil {
		return nil, fmt.Errorf("retrytopic: invalid config: %w", err)
	}
	migs, err := load(table)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: %w", err)
	}
	return &Migrator{db: db, table: table, migs: migs}, nil
}

// Migrate migrates the table in direction, each version in its own
// transaction (serialised by the schema's migration lock: every instance may
// call it at start-up), and returns the versions it applied or reverted.
// opts may be nil: up applies every pending version; down reverts only the
// newest applied one (set deduplicator.MigrateOpts.TargetVersion, -1 for
// all).
func (m *Migrator) Migrate(ctx context.Context, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	return m.migrate(ctx, m.db, direction, opts)
}

// MigrateTx is [Migrator.Migrate] on the caller's transaction.
func (m *Migrator) MigrateTx(ctx context.Context, tx pgx.Tx, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	return m.migrate(ctx, tx, direction, opts)
}

func (m *Migrator) migrate(ctx context.Context, db deduplicator.Beginner, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	if opts == nil {
		opts = &deduplicator.MigrateOpts{}
	}
	res := &deduplicator.MigrateResult{Direction: direction, Versions: []deduplicator.MigrateVersion{}}
	line := migrate.Line{Component: componentKey(m.table), Migrations: m.migs}
	steps, err := migrate.Migrate(ctx, db, m.table.Schema, migrate.Direction(direction), []migrate.Line{line}, migrate.Options{TargetVersion: opts.TargetVersion})
	for _, s := range steps {
		res.Versions = append(res.Versions, deduplicator.MigrateVersion(s))
	}
	if errors.Is(err, migrate.ErrUnknownVersion) {
		return res, fmt.Errorf("%w: %w", deduplicator.ErrUnknownVersion, err)
	}
	if err != nil {
		return res, fmt.Errorf("retrytopic: migrate %s: %w", direction, err)
	}
	return res, nil
}

// Validate reports the migrations not recorded as applied, in a
// transaction of its own.
func (m *Migrator) Validate(ctx context.Context) (*deduplicator.ValidateResult, error) {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: validate: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return m.ValidateTx(ctx, tx)
}

// ValidateTx is [Migrator.Validate] on the caller's transaction.
func (m *Migrator) ValidateTx(ctx context.Context, tx pgx.Tx) (*deduplicator.ValidateResult, error) {
	versions, err := migrate.Pending(ctx, tx, m.table.Schema, componentKey(m.table), m.migs)
	if err != nil {
		return nil, fmt.Errorf("retrytopic: validate %s.%s: %w", m.table.Schema, m.table.Table, err)
	}
	res := &deduplicator.ValidateResult{Pending: []deduplicator.Migration{}}
	for _, mig := range m.migs {
		if slices.Contains(versions, mig.Version) {
			r, err := render(m.table, mig)
			if err != nil {
				return nil, err
			}
			res.Pending = append(res.Pending, r)
		}
	}
	res.OK = len(res.Pending) == 0
	return res, nil
}

// Migrate creates or upgrades the parked-keys table t to the newest
// version: NewMigrator(db, t) then Migrate(ctx, DirectionUp, nil), for
// start-up.
func Migrate(ctx context.Context, db deduplicator.Beginner, t ParkedKeysTable) error {
	m, err := NewMigrator(db, t)
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, deduplicator.DirectionUp, nil)
	return err
}

// notMigrated is the [ErrNotMigrated] error for t's pending migrations.
func notMigrated(t ParkedKeysTable, pending []deduplicator.Migration) error {
	versions := make([]int, len(pending))
	for i, p := range pending {
		versions[i] = p.Version
	}
	return fmt.Errorf("retrytopic: %w: %s.%s has pending versions %v (run retrytopic.Migrate)", ErrNotMigrated, t.Schema, t.Table, versions)
}
