// Package retrytopic moves transient failures off their partition: after
// watermill's in-process Retry gives up, the message is republished to a
// retry topic (same event id, payload and headers, plus the retry headers)
// and the original is acked, so the partition moves on; a retry consumer
// processes the copy once its backoff has passed, and after the last
// attempt the message goes to the poison topic with the reason. It is the
// retryable-topics pattern of Spring Kafka and the kafkajs recipes, on top
// of the dedup middleware: the copy carries the same event_id and runs
// under the same dedup consumer group, so a retried event and its original
// share one claim and are applied once between them.
//
// Retry topics are opt-in. Without them a transient error that outlasts the
// in-process Retry is nacked and redelivered in a loop, which blocks its
// partition behind one bad dependency (a downstream down for one customer
// stops every customer of that partition).
//
// # Wiring
//
//	rt, err := retrytopic.New(retrytopic.Config{
//		Publisher:   kafkaPub, // publisher.NewKafkaPublisherConfig: keyed by partition_key
//		Topics:      []string{"orders.retry"},
//		PoisonTopic: "orders.poison",
//	}, logger)
//	retry := middleware.Retry{MaxRetries: 2, InitialInterval: 100 * time.Millisecond,
//		ShouldRetry: func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
//	router.AddMiddleware(rt.Middleware, retry.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
//
//	subCfg, _ := publisher.NewKafkaSubscriberConfig(kc, "billing")
//	sub, _ := kafka.NewSubscriber(subCfg, logger)
//	retryCfg, _ := retrytopic.NewKafkaSubscriberConfig(kc, "billing-retry")
//	retrySub, _ := kafka.NewSubscriber(retryCfg, logger)
//	router.AddConsumerHandler("charge", "orders", sub, charge)
//	router.AddConsumerHandler("charge-retry", "orders.retry", retrySub, charge)
//
// Both handlers use the same dedup middleware (idem.Config.ConsumerGroup
// "billing"); only the Kafka consumer group of the retry topic differs.
// The retry and poison topics are billing's own: another service consuming
// "orders" has retry topics of its own (see [Config.Topics]).
// [RetryTopic.Middleware] replaces watermill's PoisonQueue: it poisons
// permanent errors (idem.IsPermanent) itself, with topic_poisoned naming the
// original topic also for a copy that fails on a retry topic.
//
// # Holding a copy until its time
//
// Each copy carries [MetadataNotBefore] (failure time plus [Backoff]).
// [NewKafkaSubscriberConfig] installs [HoldingTracer], which holds the
// records of a partition until that time inside Sarama's consumer-group
// session: other partitions keep flowing (watermill-kafka runs partitions
// concurrently, one message in flight each), and a rebalance is not stalled
// by a held record. [RetryTopic.Middleware] also waits in the handler, for
// subscribers without the tracer; that too blocks only its partition, but
// stalls the group's rebalances for as long as it waits
// (TestHoldingTracerLetsTheGroupRebalance explains the measurement). A
// copy holds the copies behind it in its partition: with one retry topic a
// long delay holds shorter ones; one topic per attempt keeps delays alike.
//
// # Order of the events of a key
//
// By default a retried event is overtaken by the later events of its key,
// which keep flowing on the main topic: an "order shipped" can be applied
// before the "order paid" that is waiting on a retry topic. Handlers that
// cannot accept that either tolerate it (check state, not order) or set
// [Config.KeyOrder]: while a key has an event on the retry path ("parked"),
// its later events wait in a PostgreSQL table ([Migrate]) with their
// message. A success releases its row in the handler's transaction
// ([RetryTopic.ReleaseMiddleware]) and hands the key to the next waiting
// event, written to the retry path through the outbox on the same
// transaction ([KeyOrder.Outbox]). [ParkedKeys], [SummarizeParked] and
// [Unblock] are for operators. See docs/retry.md for the failure cases.
package retrytopic
