// Package middleware is the Watermill handler middleware that applies each
// event at most once per consumer group, in the same PostgreSQL transaction
// as the handler's own writes. Kafka delivers at least once; with this
// middleware the business effect lands in Postgres exactly once, whatever is
// redelivered (a crash after COMMIT, a rebalance, a replay).
//
// Import it under an alias, next to Watermill's own middleware package:
//
//	import (
//		"github.com/ThreeDotsLabs/watermill/message/router/middleware"
//		idem "github.com/idemkit/watermill-idempotency/middleware"
//	)
//
// # How a message is handled
//
// [Dedup.Middleware] reads the event id with [Config.EventIDFunc] (by
// default [publisher.EventIDFromMessage]: metadata "event_id", else the JSON
// payload field "eventId", the two agreeing when both are there), begins a
// transaction, and claims (event id, consumer group) in the processed_event
// table with INSERT ... ON CONFLICT DO NOTHING
// ([deduplicator.Deduplicator.Claim]):
//
//   - first delivery: the handler runs with the transaction in msg.Context()
//     ([TxFromContext], [MustTxFromContext], [EventIDFromContext]); when it
//     returns nil the middleware COMMITs, and only then does the router ack;
//   - duplicate: ROLLBACK, the handler is not run, the message is acked;
//   - handler error or panic: ROLLBACK, the error (or panic) propagates, the
//     message is nacked and redelivered, and the redelivery finds no claim;
//   - concurrent delivery of the same event (a rebalance): the second claim
//     waits for the first transaction, then skips (it committed) or
//     processes (it rolled back). Under REPEATABLE READ or SERIALIZABLE
//     ([Config.TxOptions]) the second fails with SQLSTATE 40001 instead,
//     returned as an ordinary, retryable error.
//
// Messages the handler returns are written to [Config.Outbox] in the same
// transaction when one is set (consume and produce commit atomically), else
// handed to the router after COMMIT. The message's original context is
// restored when the middleware returns.
//
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing"}, logger)
//	...
//	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
//		tx := idem.MustTxFromContext(msg.Context())
//		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger (amount) VALUES ($1)", amount)
//		return err
//	})
//
// Run [deduplicator.Migrate] at start-up, before [NewDedup]: NewDedup checks
// the table ([deduplicator.Check]), registers the consumer group and reads the
// table's retention state in one transaction (bounded by
// [Config.StartupTimeout], 30 s), and fails at start-up, not at the first
// message, on a missing table, a wrong key, columns or layout, or pending
// migrations (a *deduplicator.TableError), a Table.Retention that differs
// from the one recorded with the table (deduplicator.ErrRetentionMismatch),
// an [Config.IdempotencyNamespace] that differs from the group's
// (deduplicator.ErrNamespaceMismatch) or a [Config.StaleMargin] not shorter
// than the retention.
//
// # Where Retry and PoisonQueue go
//
// Order the router's middlewares poison queue, then Retry, then dedup:
//
//	poison, _ := middleware.PoisonQueueWithFilter(pub, "payments.poison", idem.IsPermanent)
//	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond,
//		ShouldRetry: func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
//	router.AddMiddleware(poison, retry.Middleware, dedup.Middleware)
//
// Retry must wrap the dedup middleware, not sit inside it: after an error
// PostgreSQL aborts the transaction, so every attempt needs a fresh one. The
// poison queue sits outside Retry so that a message is poisoned once, after
// its last attempt.
//
// # Bad input
//
// A message whose event id is missing ([publisher.ErrMissingEventID]),
// malformed ([publisher.ErrInvalidEventID]), the nil UUID
// ([publisher.ErrNilEventID]), not a UUIDv7 ([publisher.ErrNotUUIDv7],
// unless [Config.AllowNonV7]), different in the metadata and the payload
// ([publisher.ErrEventIDMismatch]) or stale ([ErrStaleEvent], see below) is
// refused before any transaction begins, with a *[publisher.EventIDError]
// telling why. These errors, [ErrMalformedPayload] and anything wrapped
// with [Permanent] satisfy [IsPermanent], so
// PoisonQueueWithFilter routes them to the poison topic (with the reason in
// the "reason_poisoned" metadata) instead of retrying forever. Nothing is
// processed without a usable id.
//
// # Retention and stale events
//
// The dedup table's retention is recorded with the table
// (deduplicator.TableConfig.Retention, deduplicator.SetRetention); the
// middleware reads it at start-up and re-reads it every
// deduplicator.RetentionRefreshInterval (a failed re-read fails the message,
// which is retried), so its stale guard and the deduplicator.Cleaner always
// agree, also after SetRetention, without a restart. A UUIDv7 older than the
// retention minus [Config.StaleMargin], or created before the Cleaner's
// highest cutoff plus the margin, may have lost its claim to the Cleaner, so
// it is refused with [ErrStaleEvent] rather than applied again
// (deduplicator.Horizon.Stale), unless the consumer group was first seen
// less than the retention minus the margin ago: a young group has lost no
// claim (the Cleaner keeps them until the group is older than the
// retention), so a new group reading a topic from the oldest offset drains
// its old backlog normally. [Config.ProcessStaleEvents] turns the refusal
// off.
//
// # Downstream calls
//
// [IdempotencyKey] and [NewIdempotencyKeyTransport] derive an
// Idempotency-Key from the event being handled, so a payment provider called
// again after a rollback sees the same key and dedups the call. Named keys
// mix in the consumer group's recorded namespace (its name at its first
// start) rather than its current name: deduplicator.RenameGroup keeps them,
// so a call retried after a rename carries the same key.
package middleware
