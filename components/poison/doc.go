// Package poison lists and replays the messages of a poison (dead-letter)
// topic: those watermill's PoisonQueue middleware, or the retrytopic
// middleware after the last attempt, published with reason_poisoned,
// topic_poisoned, handler_poisoned and subscriber_poisoned.
//
// [Replay] moves the messages that match a [Filter] (reason, original
// topic, event ids, time poisoned, time occurred) back to their original
// topic, at a rate limit, with their original headers and the poisoning
// kept in [MetadataReasonHistory]; [List] (or Config.DryRun) shows what
// would be replayed. Both are library functions, so a command (idemctl
// poison list|replay) or a one-off program can call them:
//
//	res, err := poison.Replay(ctx, poison.Config{
//		Kafka:     idemkafka.ClientConfig{Brokers: brokers},
//		Topic:     "orders.poison",
//		Publisher: kafkaPub,
//		Filter:    poison.Filter{Reason: "payment provider", PoisonedFrom: since},
//	}, logger)
//
// # Why a replay is safe
//
// A poisoned message's transaction was rolled back, claim included, so
// once the cause is fixed the replayed event is applied once. An event that
// was applied after all (replayed twice, or poisoned on a later
// redelivery) is absorbed by its claim: the consumer's dedup middleware
// skips it as a duplicate. Keep replays within the dedup retention: older
// events are refused as stale (see docs/operations.md).
package poison
