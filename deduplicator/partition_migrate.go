package deduplicator

import (
	"embed"
	"io/fs"
	"slices"

	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/partitioned/*.sql
var partitionedMigrationFiles embed.FS

// PartitionedMigrationTemplates holds the extra migrations of
// [LayoutPartitioned] (versions 100 onward), applied after those of
// [MigrationTemplates]: version 100 converts the plain table to daily RANGE
// partitions on event_id, keeping every row (its down file converts back).
// Same template conventions as MigrationTemplates.
var PartitionedMigrationTemplates fs.FS = mustSub(partitionedMigrationFiles, "migrations/partitioned")

// loadMigrations renders the migrations of cfg's layout, oldest first.
func loadMigrations(cfg TableConfig) ([]migrate.Migration, error) {
	data := templateData{Schema: cfg.Schema, Table: cfg.Table, RetentionMicros: cfg.Retention.Microseconds()}
	if cfg.Retention == 0 {
		data.RetentionMicros = DefaultRetention.Microseconds()
	}
	migs, err := migrate.Load(MigrationTemplates, data)
	if err != nil || cfg.Layout != LayoutPartitioned {
		return migs, err
	}
	more, err := migrate.Load(PartitionedMigrationTemplates, data)
	if err != nil {
		return nil, err
	}
	migs = append(migs, more...)
	slices.SortStableFunc(migs, func(a, b migrate.Migration) int { return a.Version - b.Version })
	return migs, nil
}

// templateData is what the migration templates see: the quoted names come
// from Schema and Table; RetentionMicros is the retention a new table
// records (TableConfig.Retention, or DefaultRetention).
type templateData struct {
	Schema, Table   string
	RetentionMicros int64
}
