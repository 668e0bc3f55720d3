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
// found. `make soak` runs the full version (cmd/soak); TestSoakShort
// runs a short one inside `make test`. The failover fault
// ([FaultCounts].Failover, once per full run) moves the run's database to a
// throwaway primary with an asynchronous standby (internal/testkit/
// pgcluster), cuts replication, promotes the standby and moves the
// consumers to it; TestSoakFailover runs it alone. See docs/soak.md.
package soak
