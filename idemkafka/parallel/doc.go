// Package parallel is a key-ordered parallel Watermill [Subscriber] on a
// Kafka consumer group, for the dedup middleware.
//
// watermill-kafka's subscriber hands the router one message per partition
// at a time. [Subscriber] keeps up to [SubscriberConfig.MaxInFlight]
// messages in flight over the same consumer group, in the order
// [SubscriberConfig.Ordering] asks for ([OrderKey] by default: a message
// waits only for the earlier messages of its key in its partition), and
// commits per partition only the offset below which every message is
// acked; what runs again after a crash is absorbed by the dedup claims.
// It takes idemkafka's [idemkafka.ClientConfig] (brokers, the Sarama base,
// RevokeTimeout) and applies [idemkafka.SaramaConsumerConfig] to it.
// Each message in flight holds a database connection for its transaction:
// the pool needs MaxInFlight connections (idem.Config.Concurrency).
//
//	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
//		Client:        idemkafka.ClientConfig{Brokers: brokers},
//		ConsumerGroup: "billing", MaxInFlight: 64,
//	}, logger)
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing",
//		Concurrency: sub.MaxInFlight()}, logger)
//	router.AddConsumerHandler("charge", "orders", sub, charge). // charge: a message.NoPublishHandlerFunc
//		AddMiddleware(dedup.Middleware)
//
// docs/parallel.md explains the Subscriber; docs/configuration.md lists its
// settings.
package parallel
