// Package deduplicator is the processed_event store behind the dedup
// middleware: one row per (event id, consumer group) that was applied, whose
// primary key lets PostgreSQL, not application code, decide which of two
// concurrent deliveries of an event is first.
//
// Most services use it through the middleware package and only call
// [Migrate] (or a [Migrator]) at start-up. Use a [Deduplicator] directly to dedup outside
// Watermill, in your own transaction:
//
//	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(deduplicator.TableConfig{})); err != nil { ... }
//	dedup, err := deduplicator.New(deduplicator.Config{ConsumerGroup: "billing"}, logger)
//	...
//	group, err := dedup.Register(ctx, pool, "") // at start-up: registers the consumer group
//	...
//	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		first, err := dedup.Claim(ctx, tx, eventID)
//		if err != nil || !first {
//			return err // a duplicate: nothing to do
//		}
//		return applyPayment(ctx, tx, payment) // commits with the claim
//	})
//
// # Claims
//
// [Deduplicator.Claim] runs INSERT ... ON CONFLICT DO NOTHING in the caller's
// pgx.Tx and reports whether the claim is the first. A claim becomes visible
// only when that transaction commits, so commit it with the business writes
// it protects. A concurrent claim of the same id waits for the first
// transaction: it returns false when the first commits and true when it
// rolls back (under REPEATABLE READ or SERIALIZABLE it fails with SQLSTATE
// 40001 instead; retry it). [Deduplicator.ClaimBatch] claims many ids in
// sorted order, so overlapping batches cannot deadlock.
//
// # Schema and migrations
//
// A [Migrator] creates, upgrades and downgrades the table named by
// [TableConfig] (default public.processed_event) and its two companion
// tables, <table>_setting (the retention) and <table>_group (the consumer
// groups): embedded, versioned migrations, one transaction per version,
// recorded in idem_schema_migration under processed_event:<table>,
// serialised by an advisory lock so every instance may migrate at start-up.
// [Migrator.Migrate] returns the versions it applied or reverted
// ([DirectionUp], or [DirectionDown] one version at a time unless
// [MigrateOpts.TargetVersion] says otherwise); [Migrator.MigrateTx] runs on
// the caller's transaction; [Migrator.Validate] lists the pending versions.
// [Migrate] is the start-up shorthand: up to the newest version.
//
//	migrator, err := migrate.New(pool, deduplicator.MigrationLine(table))
//	res, err := migrator.Migrate(ctx, migrate.DirectionUp, nil)
//	for _, v := range res.Versions { log.Printf("applied %s %d_%s", v.Component, v.Version, v.Name) }
//
// The outbox's tables have a Migrator of the same shape on the same engine
// and migration table (outbox.NewMigrator).
// Schema and table names must be plain identifiers ([TableConfig.Validate];
// the table at most 55 bytes, so that <table>_setting fits PostgreSQL's 63)
// and are always quoted.
// Teams that manage schemas with goose or golang-migrate take the rendered
// SQL from [Migrations] (or the raw templates in [MigrationTemplates])
// instead; that SQL records its own version in idem_schema_migration, as
// a Migrator does, so a Migrator finds nothing to apply and [Check] passes.
// Files generated from an earlier release must be regenerated.
//
// # Start-up checks
//
// [Check] verifies the live table before claims rely on it: it exists, its
// key is exactly (event_id, consumer_group), its columns and partition key
// are the expected ones, no migration is pending and its layout is
// [TableConfig.Layout]. A table that fails is a [*TableError] wrapping
// [ErrTableMissing], [ErrTableKey], [ErrTableColumns], [ErrMigrationsPending]
// or [ErrLayoutMismatch]. Migrate ends with it, and the middleware runs it at
// start-up. [ConvertTable] turns an existing table keyed otherwise (for
// instance by event_id alone, or partitioned on processed_at) into the one
// Migrate makes, keeping one row per (event_id, consumer_group).
//
// # Retention
//
// The table must not grow without bound: a [Cleaner] deletes rows older than
// the retention in bounded batches, or, with [LayoutPartitioned], drops whole
// daily partitions keyed on the UUIDv7 event id. Keep the retention longer
// than any replay of the topic; the middleware refuses events older than it
// (ErrStaleEvent) rather than reprocess them silently.
//
// The retention has one source of truth: the value recorded with the table.
// [Migrate] records [TableConfig.Retention] when it creates the table
// ([DefaultRetention], 7 days, when zero); the middleware's stale guard and
// the Cleaner read it. A non-zero TableConfig.Retention that differs is
// refused with [ErrRetentionMismatch] by Migrate, the middleware (at
// start-up and at every re-read) and [Cleaner.RunOnce]. [SetRetention]
// changes it and [RecordedRetention] reads it. Running consumers re-read it
// every [RetentionRefreshInterval], so a change needs no restart. After a
// shortening the Cleaner applies the previous, longer retention until 2 ×
// RetentionRefreshInterval after the change, when every running consumer has
// re-read the shorter one. Before deleting, each pass records its cutoff
// with the table, and the stale guard ([Horizon.Stale];
// [Deduplicator.Horizon] reads its inputs) refuses events created before it,
// so a lengthening never revives an event whose claim was already cleaned.
// A pass with [CleanerConfig.DryRun] reports what it would delete, move,
// create and drop, and changes nothing.
//
// # Inspecting a table
//
// For operators (the idemctl command is built on them): [Deduplicator.ProcessedAt]
// tells whether and when a group applied an event; [Stats] counts the claims
// per group and per partition with their oldest and newest processed_at and
// the size on disk (it reads every row); [Partitions] lists the partitions
// from the catalogs; [TableLayout] reads the live table's layout; and
// [Migrator.Status] lists the versions applied, pending or unknown.
//
// # Consumer groups
//
// [Deduplicator.Register] records a consumer group's start in <table>_group:
// when it was first seen, its Idempotency-Key namespace and its last start.
// The middleware calls it at start-up; call it yourself when you claim
// directly. [Groups] lists the registered groups. A group first seen
// less than a retention ago ([Group.Young]) cannot have lost a claim: the
// middleware lets its old events through, and the Cleaner keeps its claims,
// and any old partition holding them ([Result.YoungGroups],
// [Result.PartitionsKept]), until it is older than the retention.
//
// [RenameGroup] gives a group's claims and registration (first seen,
// Idempotency-Key namespace) to a new name in one transaction, so a renamed
// group keeps its dedup and its downstream Idempotency-Keys; [ForgetGroup]
// then removes the old name, claims included.
package deduplicator
