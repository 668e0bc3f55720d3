// Package middleware is the Watermill handler middleware that applies each
// event at most once per consumer group, in the same PostgreSQL transaction
// as the handler's own writes: Kafka delivers at least once, the business
// effect lands in Postgres once. Import it under an alias, next to
// Watermill's own middleware package:
//
//	import (
//		"time"
//
//		"github.com/ThreeDotsLabs/watermill/message"
//		"github.com/ThreeDotsLabs/watermill/message/router/middleware"
//		idem "github.com/idemkit/watermill-idempotency/middleware"
//	)
//
// Migrate deduplicator.MigrationLine at start-up, then:
//
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing"}, logger)
//	poison, _ := middleware.PoisonQueueWithFilter(pub, "payments.poison", idem.IsPermanent)
//	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond,
//		ShouldRetry: func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
//	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware)
//	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
//		tx := idem.MustTxFromContext(msg.Context())
//		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger (amount) VALUES ($1)", amount)
//		return err
//	})
//
// [Dedup.Middleware] reads the event id, asks deduplicator whether it is
// stale, begins a transaction and claims (event id, consumer group): the
// first delivery runs the handler with the transaction in msg.Context()
// ([TxFromContext]) and commits before the ack; a duplicate is acked
// without running the handler; a handler error rolls back and the message
// is redelivered. Retry must wrap the dedup middleware (every attempt needs
// a fresh transaction), and the poison queue wraps Retry. A missing,
// malformed or stale event id is refused before any transaction with a
// permanent error ([IsPermanent]). Returned messages go to [Config.Outbox]
// in the same transaction when one is set.
//
// [IdempotencyKey] and [NewIdempotencyKeyTransport] derive the
// Idempotency-Key of a downstream call from the event being handled.
// Handlers that make such calls run best in lease mode ([Config.Mode]:
// a *[LeaseConfig]): the handler holds no transaction and no connection
// while it calls; its writes, registered with [Complete], commit with the
// claim in a short transaction that first checks the delivery's lease.
// Writes registered as statements with [CompleteExec] travel with the
// check and the claims of a whole completion batch in one round trip.
// retrytopic moves transient failures to retry topics; idemtest helps
// test handlers.
//
// # database/sql: GORM, bun, ent, sqlx, sqlc
//
// A service whose data layer is written on database/sql passes its *sql.DB
// (opened with pgx's stdlib driver, as gorm.io/driver/postgres does) through
// [SQLDB]; its handlers get the message's transaction as a *sql.Tx:
//
//	// sqlDB: sql.Open("pgx", url), stdlib.OpenDBFromPool(pool), or GORM's gormDB.DB()
//	db, err := idem.SQLDB(sqlDB) // another driver (lib/pq): ErrUnsupportedDriver
//	ledger, err := idem.NewDedup(idem.Config{DB: db, ConsumerGroup: "ledger"}, logger)
//	router.AddMiddleware(ledger.Middleware)
//	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
//		tx := idem.MustSQLTxFromContext(msg.Context()) // gorm, bun, ent, sqlx or sqlc on it
//		_, err := tx.ExecContext(msg.Context(), "INSERT INTO ledger (amount) VALUES ($1)", amount)
//		return err
//	})
//
// Every mode works on it; in lease mode register the writes with
// [CompleteSQL]. The library's own statements run on the same connection
// and in the same transaction; it costs one round trip more per
// transaction than a pgx pool (database/sql sends BEGIN alone).
// examples/orm writes one handler with each of GORM, bun, ent and sqlx. docs/guarantees.md, docs/rules.md and
// docs/configuration.md explain the rules and every setting.
package middleware
