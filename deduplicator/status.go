package deduplicator

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// MigrationStatus is one version of one component as [Migrator.Status] (or
// an outbox.Migrator's) found it: applied or pending, or recorded but
// unknown to the migrator.
type MigrationStatus struct {
	// Component is the key of the version's record in idem_schema_migration
	// (see [Migration.Component]).
	Component string
	// Version and Name are the migration's; for an Unknown version, the
	// recorded ones.
	Version int
	Name    string
	// Applied is true when the version is recorded in idem_schema_migration,
	// at AppliedAt; false when it is pending.
	Applied   bool
	AppliedAt time.Time
	// Unknown is true for a version that idem_schema_migration records but
	// the migrator does not have: one of another layout (version 100 of
	// [LayoutPartitioned] under a LayoutPlain config) or of a newer release.
	// A down migration refuses to revert past it ([ErrUnknownVersion]).
	Unknown bool
}

// Status lists every version of the migrator's layout, oldest first, as
// applied (with when) or pending, followed by the versions recorded for the
// table that the migrator does not know (Unknown). It only reads, in a
// transaction of its own. [Migrator.Validate] is the shorter answer to "is
// anything pending?".
func (m *Migrator) Status(ctx context.Context) ([]MigrationStatus, error) {
	var vs []migrate.VersionStatus
	err := readTx(ctx, m.db, func(tx pgx.Tx) (err error) {
		vs, err = migrate.Status(ctx, tx, m.cfg.Schema, componentKey(m.cfg), m.migs)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("deduplicator: migration status of %s.%s: %w", m.cfg.Schema, m.cfg.Table, err)
	}
	out := make([]MigrationStatus, len(vs))
	for i, v := range vs {
		out[i] = MigrationStatus{Component: componentKey(m.cfg), Version: v.Version, Name: v.Name, Applied: v.Applied, AppliedAt: v.AppliedAt, Unknown: v.Unknown}
	}
	return out, nil
}
