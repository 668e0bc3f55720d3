package deduplicator

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
// in the idem_schema_migration table.
const component = "processed_event"

// Migration is one schema version rendered for a schema and table: write
// Up and Down to NNN_name.up.sql / NNN_name.down.sql for goose or
// golang-migrate.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// Beginner begins a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx fit.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrations returns the schema migrations rendered for cfg's schema and
// table, oldest first; with [LayoutPartitioned] they include
// [PartitionedMigrationTemplates] (version 100 onward). Write each Up/Down to files to manage the schema with
// an external tool instead of [Migrate].
//
// Each Up ends by recording its version in the schema's
// idem_schema_migration table (created if missing), and each Down by
// deleting that record, as [Migrate] does: [Check] (which the middleware
// runs at start-up) refuses a table whose migrations are not recorded.
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
		up, down, err := migrate.RecordSQL(cfg.Schema, componentKey(cfg), m)
		if err != nil {
			return nil, err
		}
		out[i] = Migration(m)
		out[i].Up = strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for deduplicator.Check.\n" + up
		if m.Down != "" {
			out[i].Down = strings.TrimRight(m.Down, "\n") + "\n" + down
		}
	}
	return out, nil
}

// Migrate creates or upgrades the processed_event table described by cfg.
// Each version runs in its own transaction; concurrent callers are
// serialised by an advisory lock, so every instance of a service may call it
// at start-up. db is a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
//
// A table that already exists is verified first: if its key, partitioning
// or columns are not what claims need (the reference recipe's PRIMARY KEY
// (event_id), or partitions on processed_at), Migrate returns a
// [*TableError] and neither changes nor records anything; [ConvertTable]
// converts such a table. After migrating, Migrate runs [Check] and returns
// its error.
func Migrate(ctx context.Context, db Beginner, cfg TableConfig) error {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	migs, err := loadMigrations(cfg)
	if err != nil {
		return err
	}
	if err := readTx(ctx, db, func(tx pgx.Tx) error { return checkBeforeMigrate(ctx, tx, cfg) }); err != nil {
		return err
	}
	if _, err := migrate.Up(ctx, db, cfg.Schema, componentKey(cfg), migs); err != nil {
		return err
	}
	if err := readTx(ctx, db, func(tx pgx.Tx) error { return check(ctx, tx, cfg, migs) }); err != nil {
		return err
	}
	// A new table recorded cfg.Retention; an existing one keeps its own.
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		_, err := effectiveRetention(ctx, tx, cfg)
		return err
	})
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
