// Package idemkafka holds the library's Kafka client side: a key-ordered
// parallel Watermill Subscriber on a Sarama consumer group.
//
// watermill-kafka's subscriber hands the router one message per partition
// at a time, so a consumer's throughput is its partitions divided by the
// handler's latency. [Subscriber] keeps up to [SubscriberConfig.MaxInFlight]
// messages in flight over the same consumer group, in the order
// [SubscriberConfig.Ordering] asks for ([OrderKey] by default: a message
// waits only for the earlier messages of its key in its partition), and
// commits per partition only the offset below which every message is
// acked. The done offsets above it go into the commit metadata, so a
// restart or rebalance does not run them again; what still runs again (a
// crash between two commits) is absorbed by the dedup middleware's claims,
// so each event is applied once per consumer group.
//
// # Wiring
//
//	sub, err := idemkafka.NewSubscriber(idemkafka.SubscriberConfig{
//		Brokers:       brokers,
//		ConsumerGroup: "billing",
//		MaxInFlight:   64,
//	}, logger)
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing",
//		Concurrency: sub.MaxInFlight()}, logger) // the pool must cover it
//	router.AddConsumerHandler("charge", "orders", sub, dedup.Middleware(charge))
//
// # Connections
//
// Every message in flight runs its handler at the same time as the others:
// with the dedup middleware in one-transaction-per-message mode each holds
// one database connection for its transaction, so the pool needs
// MaxInFlight connections (idem.Config.Concurrency refuses a smaller pool
// at start-up). With group commit the messages in flight share
// GroupCommit.Concurrency transactions instead.
package idemkafka
