package deduplicator

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

//go:embed migrations/partitioned/*.sql
var partitionedMigrationFiles embed.FS

// component is the name under which this package's migrations are recorded
// in the idem_schema_migration table, followed by ":" and the table name.
const component = "processed_event"

// componentKey names cfg's table in the migration table.
func componentKey(cfg TableConfig) string { return component + ":" + cfg.Table }

// MigrationLine returns the migration line of the processed_event table
// described by cfg (the value the middleware and the [Cleaner] get) and its
// companion tables <table>_setting and <table>_group, for a
// migrate.Migrator. Its versions are recorded under the component
// processed_event:<table>; with [LayoutPartitioned] they include versions
// 100 onward, which convert the table to daily RANGE partitions on
// event_id, keeping every row.
//
// Going up, an existing table whose key, partitioning or columns claims
// cannot rely on (the reference recipe's PRIMARY KEY (event_id), or
// partitions on processed_at) is refused with a [*migrate.TableError] before
// anything changes; [ConvertTable] converts such a table. At the newest
// version the line runs [Check] and refuses a configured retention that
// differs from the recorded one ([ErrRetentionMismatch]). An invalid cfg is
// returned by migrate.New.
func MigrationLine(cfg TableConfig) migrate.Line {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return migrate.Line{Component: componentKey(cfg), Err: fmt.Errorf("deduplicator: invalid config: %w", err)}
	}
	return migrate.Line{
		Component: componentKey(cfg),
		Schema:    cfg.Schema,
		Templates: templates(cfg),
		Data:      templateData(cfg),
		BeforeUpFunc: func(ctx context.Context, tx pgx.Tx) error {
			return checkBeforeMigrate(ctx, tx, cfg)
		},
		CheckFunc: func(ctx context.Context, tx pgx.Tx) error {
			migs, err := loadMigrations(cfg)
			if err != nil {
				return err
			}
			if err := check(ctx, tx, cfg, migs); err != nil {
				return err
			}
			// A new table recorded cfg.Retention; an existing one keeps its own.
			_, err = effectiveRetention(ctx, tx, cfg)
			return err
		},
	}
}

// templates returns the migration files of cfg's layout: those of
// LayoutPlain, and for LayoutPartitioned those of versions 100 onward too.
func templates(cfg TableConfig) []fs.FS {
	out := []fs.FS{mustSub(migrationFiles, "migrations")}
	if cfg.Layout == LayoutPartitioned {
		out = append(out, mustSub(partitionedMigrationFiles, "migrations/partitioned"))
	}
	return out
}

func mustSub(fsys fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// migrationData is what the migration templates see: the quoted names come
// from Schema and Table; RetentionMicros is the retention a new table
// records (TableConfig.Retention, or DefaultRetention).
type migrationData struct {
	Schema, Table   string
	RetentionMicros int64
}

func templateData(cfg TableConfig) migrationData {
	data := migrationData{Schema: cfg.Schema, Table: cfg.Table, RetentionMicros: cfg.Retention.Microseconds()}
	if cfg.Retention == 0 {
		data.RetentionMicros = DefaultRetention.Microseconds()
	}
	return data
}

// loadMigrations renders the migrations of cfg's layout, oldest first.
func loadMigrations(cfg TableConfig) ([]migtable.Version, error) {
	return migtable.Load(templateData(cfg), templates(cfg)...)
}

// pendingVersions returns the versions of migs not recorded for cfg's
// table.
func pendingVersions(ctx context.Context, db migrate.DBTX, cfg TableConfig, migs []migtable.Version) ([]int, error) {
	versions, err := migtable.Pending(ctx, db, cfg.Schema, componentKey(cfg), migs)
	if err != nil {
		if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
			return nil, fmt.Errorf("deduplicator: table %s.%s: cannot read %s.%s (GRANT SELECT on it to this role): %w", cfg.Schema, cfg.Table, cfg.Schema, migtable.Table, err)
		}
		return nil, fmt.Errorf("deduplicator: table %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return versions, nil
}

// migrateUp migrates cfg's line up on db, for ConvertTable.
func migrateUp(ctx context.Context, db migrate.Beginner, cfg TableConfig) error {
	return migrate.Up(ctx, db, MigrationLine(cfg))
}
