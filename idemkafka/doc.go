// Package idemkafka holds the library's Kafka client side: Sarama and
// watermill-kafka configs that produce and consume safely, and a
// key-ordered parallel Watermill [Subscriber].
//
// [WatermillPublisherConfig] and [WatermillSubscriberConfig] return
// watermill-kafka configs with the idempotent producer (acks=all,
// MaxOpenRequests=1), a [Marshaler] that keys records by the partition_key
// metadata (publisher.WithPartitionKey), and a consumer group that starts
// at the oldest offset and commits only acked offsets.
// [SaramaProducerConfig] and [SaramaConsumerConfig] apply the same settings
// to a raw Sarama config; [NewSyncProducer] builds the producer the outbox
// forwarder takes. Security settings (TLS, SASL, ClientID) pass through
// from [ClientConfig.Sarama].
//
//	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
//	pub, err := kafka.NewPublisher(pubCfg, logger)
//
// watermill-kafka's subscriber hands the router one message per partition
// at a time. [Subscriber] keeps up to [SubscriberConfig.MaxInFlight]
// messages in flight over the same consumer group, in the order
// [SubscriberConfig.Ordering] asks for ([OrderKey] by default: a message
// waits only for the earlier messages of its key in its partition), and
// commits per partition only the offset below which every message is
// acked; what runs again after a crash is absorbed by the dedup claims.
// Each message in flight holds a database connection for its transaction:
// the pool needs MaxInFlight connections (idem.Config.Concurrency).
//
//	sub, err := idemkafka.NewSubscriber(idemkafka.SubscriberConfig{
//		Brokers: brokers, ConsumerGroup: "billing", MaxInFlight: 64,
//	}, logger)
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing",
//		Concurrency: sub.MaxInFlight()}, logger)
//	router.AddConsumerHandler("charge", "orders", sub, dedup.Middleware(charge))
//
// docs/configuration.md lists every setting the configs force and why;
// docs/parallel.md explains the Subscriber.
package idemkafka
