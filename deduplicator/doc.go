// Package deduplicator is the processed_event store behind the dedup
// middleware: one row per (event id, consumer group) that was applied, whose
// primary key lets PostgreSQL decide which of two concurrent deliveries of
// an event is first. It also holds the stale rule, retention (the
// [Cleaner], daily partitions), the start-up checks and table conversion.
//
// Most services use it through the middleware and only migrate its
// [MigrationLine] at start-up. To dedup outside Watermill, claim in your own
// transaction:
//
//	table := deduplicator.TableConfig{} // public.processed_event
//	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
//		log.Fatal(err)
//	}
//	dedup, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: "billing"}, logger)
//	_, err = dedup.Register(ctx, pool, "") // at start-up
//	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if err := dedup.CheckStale(ctx, pool, eventID, time.Now()); err != nil {
//			return err // wraps ErrStaleEvent: its claim may be gone
//		}
//		first, err := dedup.Claim(ctx, tx, eventID)
//		if err != nil || !first {
//			return err // a duplicate: nothing to do
//		}
//		return applyPayment(ctx, tx, payment) // commits with the claim
//	})
//
// [Deduplicator.Claim] runs INSERT ... ON CONFLICT DO NOTHING in the
// caller's transaction: a concurrent claim of the same id waits for the
// first and is a duplicate only if that one commits.
// [Deduplicator.CheckStale] refuses an event older than the retention
// (minus [Config.StaleMargin]) in a group old enough to have lost claims,
// with an error wrapping [ErrStaleEvent].
//
// [Check] verifies a live table (a [*migrate.TableError] names the problem and the
// fix); [ConvertTable] converts a table keyed otherwise. A [Cleaner] keeps
// the table bounded; the retention is recorded with the table (idemctl
// retention show and set read and change it). Listing, renaming and
// forgetting consumer groups and the table's catalog view are the
// operator's: idemctl groups, dedup stats and serve. docs/retention.md, docs/operations.md and
// docs/guarantees.md explain the rules and their reasons.
package deduplicator
