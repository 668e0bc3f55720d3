// Package soak is the chaos soak of watermill-idempotency: a producer service
// and two consumer groups of consumer processes on a multi-partition topic,
// with faults injected at seeded random moments (processes killed with
// SIGKILL, the database refusing connections, rebalances, offset resets...),
// and a checker of the invariant "every event applied exactly once per
// consumer group" at the end. A share of the events fail transiently in the
// consumers' handler and go through retry topics (middleware/retrytopic,
// wired as docs/retry.md shows) before they succeed.
//
// [Run] builds everything in a fresh PostgreSQL database (dropped afterwards)
// and an in-process Kafka-protocol broker (or the cluster in
// [Config.Brokers]), starts each consumer by re-executing the running binary
// (whose main or TestMain calls [RunConsumerIfChild] first), and returns a
// [Report]: the faults injected, the duplicates the dedup middleware
// absorbed, the events lost or applied twice per group, and the violations
// found. The consumers run on Sarama (watermill-kafka's subscriber, or
// idemkafka's parallel one) or, with [Config.Engine] [EngineFranz], on
// idemkafka/franz: KIP-848 consumer groups (with rolling restarts in the
// fault mix) or, with [Config.Share], a KIP-932 share group, where no order
// is checked and the broker's delivery count drives the poison queue.
// `make soak` runs the full version (cmd/soak; `make soak/franz` the
// franz-go legs alone); TestSoakShort and TestSoakFranzShort run short ones
// inside `make test`. The failover fault
// ([FaultCounts].Failover; `make soak/failover`) moves the run's database to a
// throwaway primary with an asynchronous standby (internal/testkit/
// pgcluster), cuts replication, promotes the standby and moves the
// consumers to it; TestSoakFailover runs it alone. See docs/soak.md.
package soak
