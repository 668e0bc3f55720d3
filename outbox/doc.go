// Package outbox is a transactional outbox for PostgreSQL and Kafka: a
// service writes its business change and the events about it in ONE
// transaction, and a [Forwarder] delivers the committed events to Kafka with
// the idempotent producer, in order per aggregate, at least once.
//
// # Writing events
//
// Rows are written through watermill-sql v4 on the caller's pgx.Tx
// (sql.TxFromPgx), one table per topic in watermill-sql's PostgreSQL layout,
// so they commit or vanish with the business change. Every message is
// stamped first (publisher.Stamp: a UUIDv7 event_id, taken from the payload's
// JSON field eventId when it has one, occurred_at, and inside a handler
// causation_id and correlation_id).
//
//	ob, _ := outbox.New(outbox.Config{Topics: []string{"orders"}}, logger)
//	_ = migrate.Up(ctx, pool, outbox.MigrationLine(ob.Config(), "orders")) // at start-up: versioned, see Migrator
//
//	tx, _ := pool.Begin(ctx)
//	_, _ = tx.Exec(ctx, "INSERT INTO orders ...")
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	publisher.WithPartitionKey(msg, orderID)
//	_ = ob.Publisher(tx).Publish("orders", msg)
//	_ = tx.Commit(ctx)
//
// Inside a handler wrapped by the dedup middleware, [Outbox.PublisherFromContext]
// binds to the middleware's transaction; or set the middleware's Config.Outbox
// to the Outbox, and the messages a handler returns are written in that
// transaction instead of going to the router's publisher. [Outbox.PoolPublisher]
// opens its own transaction per Publish.
//
// # Forwarding
//
// The [Forwarder] reads each topic's table by watermill-sql's rule: rows
// after its position (a row of watermill-sql's offsets table keyed by
// [ForwarderConfig.Name], row-locked), only with
// transaction_id below the snapshot's xmin
// (pg_snapshot_xmin(pg_current_snapshot())), in (transaction_id, offset)
// order, a batch at a time. A transaction that is still open holds the
// position back instead of being skipped. The batch goes to Kafka in one
// SendMessages call of an idempotent Sarama producer (acks=all,
// MaxOpenRequests=1, key = partition_key), then the position advances in the
// same Postgres transaction. A crash in between resends the batch: consumers
// dedup by event_id.
//
// The forwarder never deletes rows; [Outbox.DeleteForwarded] removes those
// every listed forwarder (and watermill-sql subscriber) has passed, and
// [Outbox.Backlog] reports what a forwarder has not sent yet.
//
// # Migrations
//
// A [Migrator] (built from the same [Config]) creates each topic's two
// tables, exactly as watermill-sql v4 makes them, as embedded, versioned
// migrations recorded per topic in idem_schema_migration, on the engine and
// migration table of [deduplicator.Migrator] and with its shape and types:
// [Migrator.Migrate] returns what it applied, [Migrator.MigrateTx] runs on
// the caller's transaction, [Migrator.Validate] lists the pending versions,
// [migrate.DirectionDown] reverts. [Outbox.Migrate] is the start-up shorthand.
// Tables an earlier release made without versions are adopted as version 1
// when their shape matches. [Migrations] renders the SQL, with its record,
// for goose or golang-migrate. [Outbox.Check] and [NewForwarder] refuse
// missing tables, tables of another shape and unrecorded versions.
//
// See docs/outbox.md for the visibility rule, ordering, failure behaviour and
// the measured throughput.
package outbox
