// Package progresssql holds the statements on a processed_event table's
// companion <table>_progress: each consumer group's position per Kafka
// partition, kept with the claims it covers (DESIGN §12), and the seam by
// which the dedup middleware adds its write to the claim's round trip.
//
// Two writers, never both for one group: the dedup middleware, in the claim
// transaction of a message from watermill-kafka's subscriber (one message in
// flight per partition, so the row lock it takes until COMMIT is never
// contended), and the parallel subscriber, which writes its committed
// offset and the done runs above it once their messages are acked (their
// transactions committed before). Either way a row's value is written after
// the commits it covers, in PostgreSQL's single WAL history: a promoted
// asynchronous standby or a point-in-time restore that holds the value holds
// those commits too.
package progresssql
