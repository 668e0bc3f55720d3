// Package idemotel exports the counters of the dedup middleware and the
// outbox forwarder, and the outbox backlog, through the OpenTelemetry metric
// API: the same numbers that middleware/idemprom gives Prometheus, for
// services that ship metrics over OTLP (or any other OpenTelemetry
// exporter). It lives apart from the core packages, like idemprom, so that
// services not using it never link the metric API's instruments. idemprom
// is unchanged; use one or the other (or both: they read the same counters).
//
//	m, err := idemotel.New(meterProvider)                  // nil: otel.GetMeterProvider()
//	m.AddDedup(dedup)                                      // *middleware.Dedup
//	m.AddForwarder(outbox.DefaultForwarderName, forwarder) // *outbox.Forwarder, by its Name
//	m.AddOutboxBacklog(ob, pool, nil)                      // outbox lag, queried at collection
//	defer m.Close()                                        // unregisters the callback
//
// All instruments are asynchronous (observable): one callback reads
// (*middleware.Dedup).Stats, (*outbox.Forwarder).Stats and
// (*outbox.Outbox).Backlog when the reader collects, so the message path
// pays nothing for them.
//
// # Instruments
//
// The names follow the OpenTelemetry naming rules (dot-separated namespace,
// no unit in the name, the unit as UCUM, cumulative time as ".time") and
// map one to one to idemprom's. Attributes: group is
// messaging.consumer.group.name (semantic conventions), reason is
// idem.reject_reason, forwarder is idem.outbox.forwarder.name (the forwarder's
// Name), topic is messaging.destination.name, partition is
// messaging.destination.partition.id. Counters are int64 except the
// two times (float64 seconds); "-" marks the group-commit counters, which
// idemprom does not export.
//
//	name                            kind     unit           attributes        idemprom
//	idem.dedup.processed            counter  {message}      group             idem_dedup_processed_total
//	idem.dedup.duplicates           counter  {message}      group             idem_dedup_duplicates_total
//	idem.dedup.failed               counter  {message}      group             idem_dedup_failed_total
//	idem.dedup.claim_errors         counter  {message}      group             idem_dedup_claim_errors_total
//	idem.dedup.rejected             counter  {message}      group, reason     idem_dedup_rejected_total
//	idem.dedup.claim.time           counter  s              group             idem_dedup_claim_seconds_total
//	idem.dedup.claims               counter  {claim}        group             idem_dedup_claims_total
//	idem.dedup.tx.time              counter  s              group             idem_dedup_tx_seconds_total
//	idem.dedup.group.commits        counter  {transaction}  group             -
//	idem.dedup.group.messages       counter  {message}      group             -
//	idem.dedup.group.fallbacks      counter  {transaction}  group             -
//	idem.dedup.alone                counter  {message}      group             -
//	idem.outbox.forwarded           counter  {message}      forwarder         idem_outbox_forwarded_total
//	idem.outbox.forwarder.commits   counter  {commit}       forwarder         idem_outbox_forwarder_commits_total
//	idem.outbox.forwarder.polls     counter  {poll}         forwarder         idem_outbox_forwarder_polls_total
//	idem.outbox.forwarder.errors    counter  {batch}        forwarder         idem_outbox_forwarder_errors_total
//	idem.outbox.pending             gauge    {message}      topic, forwarder  idem_outbox_pending_rows
//	idem.outbox.oldest_pending_age  gauge    s              topic, forwarder  idem_outbox_oldest_pending_seconds
//	idem.kafka.in_flight            gauge    {message}      group             idem_kafka_in_flight
//	idem.kafka.max_in_flight        gauge    {message}      group             idem_kafka_max_in_flight
//	idem.kafka.keys_waiting         gauge    {message}      group             idem_kafka_keys_waiting
//	idem.kafka.held                 gauge    {message}      group             idem_kafka_held
//	idem.kafka.acked                counter  {message}      group             idem_kafka_acked_total
//	idem.kafka.nacked               counter  {message}      group             idem_kafka_nacked_total
//	idem.kafka.skipped              counter  {message}      group             idem_kafka_skipped_total
//	idem.kafka.sessions             counter  {session}      group             idem_kafka_sessions_total
//	idem.kafka.partition.distance   gauge    {message}      group, topic, partition  idem_kafka_partition_distance
//	idem.kafka.partition.window     gauge    {message}      group, topic, partition  idem_kafka_partition_window
//
// The reasons of idem.dedup.rejected are the values the dedup span records
// in idem.reject_reason (missing_event_id, invalid_event_id, nil_event_id,
// not_uuidv7, event_id_mismatch, stale), so a metric and the spans behind
// it are filtered with the same value. idem.dedup.claim.time divided by
// idem.dedup.claims is the mean claim wait (the counters are sums, as in
// idemprom: Stats keeps no distribution).
//
// The counters are cumulative since the component was created; two
// middlewares of the same consumer group are summed. The backlog gauges are
// queried from the database at each collection (bounded by
// [BacklogTimeout]); a failed query reports no value for that collection
// (never a stale one) and the callback returns the error to the SDK.
package idemotel
