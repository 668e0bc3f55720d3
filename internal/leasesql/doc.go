// Package leasesql is lease mode's protocol on the database: the
// statements that take, complete, renew and release a lease, and the fast
// path's transaction that holds a batch's events while their handlers run.
// deduplicator, the one writer of the claim table, builds each Protocol
// (bound to its table and consumer group) and owns the lease table (its
// migration, its sweep); the middleware's lease mode runs the Protocol it
// gets from its Deduplicator through [Of]. [List], [Summarize] and [ForceRelease] are the operator's
// (idemctl dedup leases and release, and its console).
//
// Every take of a lease first takes the event's advisory lock
// (pg_try_advisory_xact_lock on [Protocol.LockKey]) in its transaction: a
// take of a lease row, and the fast path's open, which holds it while the
// handler runs. Neither waits for it: an event whose lock another
// transaction holds is busy, and the delivery polls as for a live lease.
// So advisory locks never form a wait cycle, and a fast-path transaction
// whose client vanished (ended by the server after the lease's duration
// idle: idle_in_transaction_session_timeout) holds no other take in a lock
// wait. Completions, renewals and releases change only rows their token
// holds and take no advisory lock.
package leasesql
