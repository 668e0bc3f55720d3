// Package retrytopic moves transient failures off their partition: after
// watermill's in-process Retry gives up, the message is republished to a
// retry topic (same event id, payload and headers, plus the retry headers)
// and the original is acked, so the partition moves on; a retry consumer
// processes the copy once its [Backoff] has passed, and after the last
// attempt the message goes to the poison topic with the reason. The copy
// runs under the same dedup consumer group, so a retried event and its
// original share one claim and are applied once between them.
//
//	rt, err := retrytopic.New(retrytopic.Config{
//		Publisher:   kafkaPub, // idemkafka.WatermillPublisherConfig: keyed by partition_key
//		Topics:      []string{"orders.retry"},
//		PoisonTopic: "orders.poison",
//	}, logger)
//	retry := middleware.Retry{MaxRetries: 2, InitialInterval: 100 * time.Millisecond,
//		ShouldRetry: func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
//	router.AddMiddleware(rt.Middleware, retry.Middleware, dedup.Middleware, rt.ReleaseMiddleware)
//
//	subCfg, _ := idemkafka.WatermillSubscriberConfig(kc, "billing")
//	sub, _ := kafka.NewSubscriber(subCfg, logger)
//	retryCfg, _ := idemkafka.WatermillSubscriberConfig(kc, "billing-retry")
//	retryCfg.Tracer = retrytopic.HoldingTracer(retryCfg.Tracer)
//	retrySub, _ := kafka.NewSubscriber(retryCfg, logger)
//	router.AddConsumerHandler("charge", "orders", sub, charge)
//	router.AddConsumerHandler("charge-retry", "orders.retry", retrySub, charge)
//
// Both handlers use the same dedup middleware; only the Kafka consumer
// group of the retry topic differs (name it in idem.Config.KafkaGroups, so
// that its partitions' positions are written at assignment and survive a
// failover to an asynchronous standby). [RetryTopic.Middleware] replaces
// watermill's PoisonQueue. The retry consumer's [HoldingTracer] holds a copy until its [MetadataNotBefore] time
// inside Sarama's session, so other partitions and rebalances keep going.
//
// [Config.KeyOrder] keeps the events of a key in order: while a key has an
// event on the retry path, its later events wait in a PostgreSQL table
// ([MigrationLine]) with their message. A success releases its row in the
// handler's transaction ([RetryTopic.ReleaseMiddleware]) and hands the key
// to the next waiting event through the outbox ([KeyOrder.Outbox]).
// [Unblock] is for operators (idemctl retry unblock); idemctl retry parked
// lists the parked keys.
// docs/retry.md explains the wiring, the failure cases and the measurements.
package retrytopic
