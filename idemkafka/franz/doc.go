// Package franz is the franz-go engine: a Watermill [Subscriber] and
// [Publisher] on github.com/twmb/franz-go, beside idemkafka/parallel's
// Sarama one, for what Sarama cannot speak (KIP-848 consumer groups) and
// less CPU per event.
//
// The [Subscriber] keeps idemkafka/parallel's guarantees: up to
// [SubscriberConfig.MaxInFlight] messages in flight, in the order its
// Ordering asks for (parallel.OrderKey by default: a message waits only for
// the earlier messages of its key in its partition, so a failing key holds
// neither the other keys nor the other partitions), a commit per partition
// only of the offset below which every message is acked, and a bounded
// window per partition whose fetching pauses when it is full. What runs
// again after a crash or rebalance is absorbed by the dedup claims.
//
// The group protocol is the classic one with the cooperative-sticky
// balancer by default; GroupProtocol "consumer" selects KIP-848, and
// Subscribe returns an [*UnsupportedError] when the broker does not speak
// it. With [SubscriberConfig].ShareGroup it joins a KIP-932 share group
// instead (no order: see docs/engines.md). [NewSyncProducer] is the outbox
// forwarder's producer on franz-go, transactional with a TransactionalID.
//
//	sub, err := franz.NewSubscriber(franz.SubscriberConfig{
//		Brokers: brokers, ConsumerGroup: "billing", MaxInFlight: 64,
//	}, logger)
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing",
//		Concurrency: sub.MaxInFlight()}, logger)
//	router.AddConsumerHandler("charge", "orders", sub, charge). // charge: a message.NoPublishHandlerFunc
//		AddMiddleware(dedup.Middleware)
//
// docs/engines.md compares the engines.
package franz
