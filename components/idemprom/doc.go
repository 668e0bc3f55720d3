// Package idemprom exports the counters of the dedup middleware, the outbox
// forwarder, retry topics and the idemkafka parallel subscriber to
// Prometheus. It lives apart from the core packages (like
// franz-go's plugin/kprom) so that services not using Prometheus never link
// it.
//
//	c := idemprom.NewCollector()
//	c.AddDedup(dedup)                                      // *middleware.Dedup
//	c.AddForwarder(outbox.DefaultForwarderName, forwarder) // *outbox.Forwarder, by its Name
//	c.AddOutboxBacklog(ob, pool, nil)                      // outbox lag, queried at scrape
//	c.AddRetryTopic("billing", rt)                         // *retrytopic.RetryTopic counters
//	c.AddParked(pool, retrytopic.ParkedKeysTable{}, "billing") // KeyOrder's parked keys, queried at scrape
//	c.AddSubscriber(psub)                                  // *parallel.Subscriber (the parallel subscriber)
//	c.AddTable(pool, deduplicator.TableConfig{})           // the dedup table from the catalog, queried at scrape
//	prometheus.MustRegister(c)
//
// The backlog, parked and table gauges are queried from the database at scrape
// time: one query per source per scrape at most, all under one 5 s
// deadline, and scrapes arriving while a read is in flight share it. The
// idem_kafka gauges read from the subscriber;
// the counters are cumulative since the component was created. Two
// middlewares or subscribers of one consumer group are summed.
// docs/observability.md lists every metric and what to alert on;
// deploy/grafana and deploy/prometheus hold a dashboard and alert rules
// over them.
package idemprom
