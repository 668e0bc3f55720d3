// Package migrate creates and upgrades the library's tables: one [Migrator]
// over the lines its components contribute, each line a chain of embedded,
// versioned migrations recorded in the schema's idem_schema_migration
// table.
//
//	m, err := migrate.New(pool,
//		deduplicator.MigrationLine(deduplicator.TableConfig{}),
//		outbox.MigrationLine(outboxCfg, "orders"),
//		retrytopic.MigrationLine(retrytopic.ParkedKeysTable{}),
//	)
//	res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
//
// [Up] is the same in one call, for start-up. Every version runs in its own
// transaction under a per-schema advisory lock, so every instance of a
// service may migrate at start-up; [Migrator.MigrateTx] runs on the
// caller's transaction. [Migrator.Status] lists each version as applied or
// pending, [Migrator.Validate] answers "is anything pending?", and
// [Migrator.Migrations] renders the SQL for goose or golang-migrate (each
// file records its version, so the start-up checks accept the tables).
//
// [Beginner] and [DBTX] are the database interfaces every package of the
// module takes: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx fit both.
// docs/operations.md describes the migration table and the versions.
package migrate
