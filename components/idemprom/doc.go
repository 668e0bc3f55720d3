// Package idemprom exports the counters of the dedup middleware and the
// outbox forwarder to Prometheus. It lives apart from the core packages (like
// franz-go's plugin/kprom) so that services not using Prometheus never link
// it.
//
//	c := idemprom.NewCollector()
//	c.AddDedup(dedup)                                      // *middleware.Dedup
//	c.AddForwarder(outbox.DefaultForwarderName, forwarder) // *outbox.Forwarder, by its Name
//	c.AddOutboxBacklog(ob, pool, nil)                      // outbox lag, queried at scrape
//	c.AddRetryTopic("billing", rt)                         // *retrytopic.RetryTopic counters
//	c.AddParked(pool, retrytopic.ParkedKeysTable{}, "billing") // KeyOrder's parked keys, queried at scrape
//	c.AddSubscriber(sub)                                   // *idemkafka.Subscriber (the parallel subscriber)
//	prometheus.MustRegister(c)
//
// # Metrics
//
//	idem_dedup_processed_total{consumer_group}          handler ran, COMMIT succeeded
//	idem_dedup_duplicates_total{consumer_group}         acked without running the handler
//	idem_dedup_failed_total{consumer_group}             rolled back (handler error/panic, outbox or COMMIT failure)
//	idem_dedup_claim_errors_total{consumer_group}       BEGIN or claim failed (connection, SQLSTATE 40001)
//	idem_dedup_rejected_total{consumer_group,reason}    refused before SQL: missing, invalid, nil, not_v7, stale
//	idem_dedup_claim_seconds_total{consumer_group}      time in BEGIN + claim, including waits on a concurrent claim
//	idem_dedup_claims_total{consumer_group}             claims timed (divide the two for the mean claim wait)
//	idem_dedup_tx_seconds_total{consumer_group}         BEGIN to COMMIT of processed messages
//	idem_dedup_groups_total{consumer_group}             group-commit transactions (Config.GroupCommit) that claimed their messages
//	idem_dedup_grouped_messages_total{consumer_group}   messages claimed in them (divide by groups for the mean group size)
//	idem_dedup_group_fallbacks_total{consumer_group}    groups rolled back by a handler error or panic, messages then processed alone
//	idem_dedup_alone_total{consumer_group}              group-commit mode: messages processed in their own transaction
//	idem_outbox_forwarded_total{forwarder}              rows sent to Kafka and acknowledged in the database
//	idem_outbox_forwarder_commits_total{forwarder}      committed position updates
//	idem_outbox_forwarder_polls_total{forwarder}        reads of the outbox
//	idem_outbox_forwarder_errors_total{forwarder}       failed batches (rolled back, retried)
//	idem_outbox_pending_rows{topic,forwarder}           outbox rows not forwarded yet (AddOutboxBacklog)
//	idem_outbox_oldest_pending_seconds{topic,forwarder}  age of the oldest of them
//	idem_retry_{retried,recovered,poisoned}_total{consumer_group}  retry-topic middleware (AddRetryTopic)
//	idem_retry_{followed,released,handed_off}_total{consumer_group}  KeyOrder: parked behind, released, handed on
//	idem_retry_parked_keys{consumer_group}              KeyOrder: parked keys (AddParked, queried at scrape)
//	idem_retry_parked_events{consumer_group}            their events; _max_queue: the longest queue of a key
//	idem_retry_parked_oldest_seconds{consumer_group}    age of the oldest parked event
//	idem_retry_parked_head_overdue_seconds{consumer_group}  longest time a first event's copy has been due
//	idem_kafka_in_flight{consumer_group}                parallel subscriber (AddSubscriber): messages handed out, not acked or nacked
//	idem_kafka_max_in_flight{consumer_group}            its MaxInFlight (in_flight / max_in_flight: how busy it is)
//	idem_kafka_keys_waiting{consumer_group}             records waiting behind an earlier message of their key
//	idem_kafka_held{consumer_group}                     records waiting for their not-before time (retry topics)
//	idem_kafka_{acked,nacked,skipped,sessions}_total{consumer_group}  acks, nacks, records skipped as done (commit metadata), group sessions (rebalances)
//	idem_kafka_partition_distance{consumer_group,topic,partition}  highest offset handed out + 1 - committed offset
//	idem_kafka_partition_window{consumer_group,topic,partition}    records held from the committed offset on
//
// The backlog and parked gauges are queried from the database at scrape
// time, the idem_kafka gauges read from the subscriber; all others are
// counters, cumulative since the component was created. Alert on
// a growing rate of rejected or failed messages and, in group-commit mode,
// of group fallbacks (each one retries a whole group alone), and on a
// growing idem_outbox_oldest_pending_seconds (a stopped forwarder, or one held back by
// an old transaction on the server). With the parallel subscriber, a
// partition distance that keeps growing is a message stuck in flight (its
// key and everything above the committed offset wait, and a crash would
// run them again), and keys_waiting near the window is a hot key.
package idemprom
