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
// With [SubscriberConfig].Progress the group's position is kept in
// PostgreSQL with the claims (DESIGN §12), as idemkafka/parallel's
// Subscriber keeps it: each partition's commit offset is written to the
// claims' <table>_progress after the acks it covers and before the Kafka
// commit, and every assignment (cooperative-sticky and KIP-848 alike)
// starts each partition from it through franz-go's AdjustFetchOffsetsFn,
// before the partition's first fetch. PostgreSQL wins over Kafka's
// committed offset, so a failover to an asynchronous standby or a
// point-in-time restore loses no event: the lost transactions' events are
// handed out again. A write (or, for an idle member, a check once per
// CommitInterval) that finds the server on a new timeline restarts the
// member's partitions from the new history's position. The share-group
// subscriber keeps no position: a share group has no offsets
// (docs/guarantees.md).
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
//		Progress: pool, // the dedup middleware's database
//	}, logger)
//	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing",
//		Concurrency: sub.MaxInFlight()}, logger)
//	router.AddConsumerHandler("charge", "orders", sub, charge). // charge: a message.NoPublishHandlerFunc
//		AddMiddleware(dedup.Middleware)
//
// docs/engines.md compares the engines.
package franz
