package deduplicator

import (
	"embed"
	"io/fs"
	"slices"

	"github.com/idemkit/watermill-idempotency/internal/migrate"
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
	migs, err := migrate.Load(MigrationTemplates, cfg)
	if err != nil || cfg.Layout != LayoutPartitioned {
		return migs, err
	}
	more, err := migrate.Load(PartitionedMigrationTemplates, cfg)
	if err != nil {
		return nil, err
	}
	migs = append(migs, more...)
	slices.SortStableFunc(migs, func(a, b migrate.Migration) int { return a.Version - b.Version })
	return migs, nil
}
