// Package idemtest helps users of watermill-idempotency test their own
// handlers, in the spirit of River's rivertest: assertions against the real
// database and a transactional redelivery runner.
//
//   - [RequireProcessed] and [RequireNotProcessed] assert that an event has
//     (or has not) been applied by a consumer group, that is, that its claim
//     committed in the processed_event table;
//   - [RequireOutboxMessage] and [RequireNoOutboxMessage] assert that the
//     outbox holds (or does not hold) a message for a topic, optionally with
//     a given event id, causation id, metadata and exact count;
//   - each takes a pool (what committed) or, where rivertest has a Tx twin,
//     the code under test's pgx.Tx (what it sees, its uncommitted writes
//     included);
//   - [RunWithRedelivery] delivers one message several times, sequentially and
//     concurrently, through the dedup middleware (Watermill's Duplicator idea,
//     but transactional), optionally rolling back the first run after the
//     handler returned, and fails the test unless exactly one run committed.
//     Assert your own business rows afterwards: a handler that writes outside
//     the middleware's transaction (the pool instead of
//     middleware.MustTxFromContext) shows up as a second effect.
//   - [RequireCompatible] checks an event contract (package contract) against
//     golden payloads of its published versions: BACKWARD (the new reader
//     reads every published payload) and FORWARD (the previous reader reads
//     the new struct's payloads), naming the field and the rule that broke.
//
// The kit gives a handler test its infrastructure, real and throwaway:
//
//   - [Schema] creates a PostgreSQL schema for the test (DATABASE_URL) and
//     returns a pool whose search_path is that schema, dropped when the test
//     ends;
//   - [Kafka] returns a Kafka-protocol broker for the test: KAFKA_BROKERS
//     when set, otherwise an in-process broker (franz-go's kfake, with the
//     library's patches to its group coordinator) reached over TCP by the
//     real clients; [StartKafka] is the same for a program.
//
// ExampleKafka is a whole handler test: the event published twice, consumed
// through the dedup middleware, the handler run once.
//
// Every helper takes a testing.TB and fails it with Fatalf, like testify's
// require.
//
//	res := idemtest.RunWithRedelivery(ctx, t, dedup, handler, msg, &idemtest.RedeliveryOpts{Deliveries: 5, RollbackFirst: true})
//	idemtest.RequireProcessed(ctx, t, pool, deduplicator.TableConfig{}, "billing", res.EventID)
//	idemtest.RequireOutboxMessage(ctx, t, pool, ob, "invoices", &idemtest.RequireOutboxOpts{CausationID: res.EventID, Count: 1})
//	// then: SELECT count(*) FROM payment WHERE event_id = $1  -> 1
package idemtest
