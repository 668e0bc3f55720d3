// Package failover holds the tests of DESIGN §12 against real PostgreSQL
// clusters made by the tests themselves (internal/testkit/pgcluster): a
// failover to an asynchronous streaming standby that had not received the
// last transactions, and a point-in-time restore, each with the consumers
// moved to the new database and every event checked to be applied exactly
// once, in key order. They skip where the PostgreSQL 15 server programs are
// missing.
//
// IDEM_FAILOVER_PROGRESS=off runs them with the position kept only in
// Kafka (no PostgreSQL progress, no rewind): they then fail, counting the
// events lost.
package failover
