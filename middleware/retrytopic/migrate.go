package retrytopic

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/migrate"
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

// Migration is one schema version rendered for a schema and table: write Up
// and Down to NNN_name.up.sql / NNN_name.down.sql for goose or
// golang-migrate.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

func load(t ParkedKeysTable) ([]migrate.Migration, error) {
	return migrate.Load(MigrationTemplates, struct{ Schema, Table string }{t.Schema, t.Table})
}

// Migrations returns the parked-keys table's migrations rendered for t,
// oldest first. Each Up ends by recording its version in the schema's
// idem_schema_migration table, and each Down by deleting that record, as
// [Migrate] does ([New] refuses a table whose versions are not recorded).
func Migrations(t ParkedKeysTable) ([]Migration, error) {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return nil, err
	}
	migs, err := load(t)
	if err != nil {
		return nil, err
	}
	out := make([]Migration, len(migs))
	for i, m := range migs {
		up, down, err := migrate.RecordSQL(t.Schema, componentKey(t), m)
		if err != nil {
			return nil, err
		}
		out[i] = Migration(m)
		out[i].Up = strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for retrytopic.New.\n" + up
		if m.Down != "" {
			out[i].Down = strings.TrimRight(m.Down, "\n") + "\n" + down
		}
	}
	return out, nil
}

// Migrate creates or upgrades the parked-keys table of [KeyOrder], with the
// library's migrator: one transaction per version, serialised by an advisory
// lock (every instance may call it at start-up), recorded in the schema's
// idem_schema_migration table. db is a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
func Migrate(ctx context.Context, db Beginner, t ParkedKeysTable) error {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	migs, err := load(t)
	if err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	if _, err := migrate.Up(ctx, db, t.Schema, componentKey(t), migs); err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	return nil
}

// pending returns the versions of t that are not recorded as applied.
func pending(ctx context.Context, db Beginner, t ParkedKeysTable) ([]int, error) {
	migs, err := load(t)
	if err != nil {
		return nil, err
	}
	var versions []int
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		versions, err = migrate.Pending(ctx, tx, t.Schema, componentKey(t), migs)
		return err
	})
	if err != nil {
		return nil, err
	}
	return versions, nil
}

// notMigrated is the [ErrNotMigrated] error for t.
func notMigrated(t ParkedKeysTable, versions []int) error {
	return fmt.Errorf("retrytopic: %w: %s.%s has pending versions %v (run retrytopic.Migrate)", ErrNotMigrated, t.Schema, t.Table, versions)
}
