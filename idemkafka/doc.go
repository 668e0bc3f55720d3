// Package idemkafka holds the library's Kafka client side: Sarama and
// watermill-kafka configs that produce and consume safely.
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
// The key-ordered parallel Watermill subscriber, built on these configs, is
// package [github.com/idemkit/watermill-idempotency/idemkafka/parallel].
//
// docs/configuration.md lists every setting the configs force and why.
package idemkafka
