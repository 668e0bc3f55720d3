// Package idemotel exports the counters of the dedup middleware, the
// outbox forwarder and the idemkafka parallel subscriber, and the outbox
// backlog, through the OpenTelemetry metric API: the numbers components/idemprom gives Prometheus, for services that
// ship metrics over OTLP or any other OpenTelemetry exporter.
//
//	m, err := idemotel.New(meterProvider)                  // nil: otel.GetMeterProvider()
//	m.AddDedup(dedup)                                      // *middleware.Dedup
//	m.AddForwarder(outbox.DefaultForwarderName, forwarder) // *outbox.Forwarder, by its Name
//	m.AddOutboxBacklog(ob, pool, nil)                      // outbox lag, queried at collection
//	m.AddSubscriber(psub)                                  // *parallel.Subscriber (idem.kafka.*)
//	defer m.Close()                                        // unregisters the callback
//
// All instruments are observable: one callback reads the components' Stats
// (and queries the backlog, bounded by 5 s) when the reader collects, so the
// message path pays nothing for them. Counters are cumulative since the
// component was created; two middlewares (or idemkafka subscribers) of the
// same consumer group are summed, a subscriber's partitions labelled with
// messaging.destination.name and messaging.destination.partition.id. A failed backlog query reports no value for that collection and
// returns the error to the SDK. docs/observability.md lists every
// instrument, its unit and attributes, and its idemprom counterpart.
package idemotel
