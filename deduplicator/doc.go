// Package deduplicator is the processed_event store behind the dedup
// middleware: one row per (event id, consumer group) that was applied, whose
// primary key lets PostgreSQL, not application code, decide which of two
// concurrent deliveries of an event is first.
//
// Most services use it through the middleware package and only call
// [Migrate] at start-up. Use a [Deduplicator] directly to dedup outside
// Watermill, in your own transaction:
//
//	if err := deduplicator.Migrate(ctx, pool, deduplicator.TableConfig{}); err != nil { ... }
//	dedup, err := deduplicator.New(deduplicator.Config{ConsumerGroup: "billing"}, logger)
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
// [Migrate] creates or upgrades the table named by [TableConfig] (default
// public.processed_event): embedded, versioned migrations, one transaction
// per version, recorded in idem_schema_migration, serialised by an advisory
// lock so every instance may call it at start-up. Schema and table names
// must be plain identifiers ([TableConfig.Validate]) and are always quoted.
// Teams that manage schemas with goose or golang-migrate take the rendered
// SQL from [Migrations] (or the raw templates in [MigrationTemplates])
// instead.
//
// # Retention
//
// The table must not grow without bound: a [Cleaner] deletes rows older than
// the retention ([DefaultRetention], 7 days) in bounded batches, or, with
// [LayoutPartitioned], drops whole daily partitions keyed on the UUIDv7
// event id. Keep the retention longer than any replay of the topic; the
// middleware refuses events older than it (ErrStaleEvent) rather than
// reprocess them silently.
package deduplicator
