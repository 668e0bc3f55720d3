// Package outbox is a transactional outbox for PostgreSQL and Kafka: a
// service writes its business change and the events about it in ONE
// transaction, and a [Forwarder] delivers the committed events to Kafka with
// the idempotent producer, in order per aggregate, at least once.
//
// Rows are written through watermill-sql v4 on the caller's pgx.Tx, one
// table per topic in watermill-sql's PostgreSQL layout, each message stamped
// first (publisher.Stamp). Each topic's tables are a [MigrationLine]:
//
//	cfg := outbox.Config{Topics: []string{"orders"}}
//	ob, _ := outbox.New(cfg, logger)
//	_ = migrate.Up(ctx, pool, outbox.MigrationLine(cfg, "orders")) // at start-up
//
//	tx, _ := pool.Begin(ctx)
//	_, _ = tx.Exec(ctx, "INSERT INTO orders ...")
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	publisher.WithPartitionKey(msg, orderID)
//	_ = ob.Publisher(tx).Publish("orders", msg)
//	_ = tx.Commit(ctx)
//
// Inside a handler wrapped by the dedup middleware,
// [Outbox.PublisherFromContext] binds to the middleware's transaction; or
// set the middleware's Config.Outbox to the Outbox, and the messages a
// handler returns are written in that transaction. [Outbox.PoolPublisher]
// opens its own transaction per Publish. [Outbox.SQLPublisher] writes on a
// *sql.Tx (a *sql.DB opened with pgx's stdlib driver: GORM, bun, ent, sqlx
// or sqlc transactions, or the one idem.SQLTxFromContext returns).
//
// The [Forwarder] reads each topic's committed rows in commit order, in
// cuts between two snapshots: a transaction still open delays only its own
// rows, which go out in the first cut after its commit, never skipped. It
// sends a batch with one SendMessages call and advances its position in
// the same PostgreSQL transaction; a crash in between resends
// the batch, and consumers dedup by event_id. [Outbox.DeleteForwarded]
// removes forwarded rows, [Outbox.Backlog] reports the lag, [Outbox.Check]
// verifies the tables. docs/outbox.md explains the visibility rule,
// ordering, failure behaviour and the measured throughput.
package outbox
