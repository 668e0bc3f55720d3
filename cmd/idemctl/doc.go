// Command idemctl operates the tables of watermill-idempotency from a shell,
// with the library's own functions: migrations, "was this event processed?",
// retention passes, partitions, the outbox backlog, the consumer-group
// registry, and listing and replaying a poison topic.
//
// Install it with
//
//	go install github.com/idemkit/watermill-idempotency/cmd/idemctl@latest
//
// Usage:
//
//	idemctl [flags] COMMAND SUBCOMMAND [ARGS] [flags]
//
//	migrate status|up|down|sql   versioned migrations of the dedup table and the outbox topics
//	dedup check EVENT_ID         processed by the group(s)? when?
//	dedup convert [--dry-run]    convert an existing processed_event table
//	dedup stats                  claims per group and per partition, oldest/newest, size
//	cleanup run [--dry-run]      one retention pass of the Cleaner
//	partitions list|maintain     the daily partitions of a partitioned table
//	outbox backlog|prune         rows not yet forwarded; delete those forwarded
//	groups list|rename|forget    the consumer-group registry
//	retention show|set           the table's recorded retention
//	poison list|replay           a poison topic's messages; publish them back to their topics
//
// It reads PostgreSQL from DATABASE_URL (or --database-url) and Kafka from
// KAFKA_BROKERS (or --brokers), over TLS and SASL when KAFKA_TLS*,
// KAFKA_SASL_* (or the --kafka-* flags) say so. Output is a table for
// people, JSON with --json (errors too). Exit codes: 0 done, 1 failed, 2 bad usage or input (nothing
// changed), 3 dedup check: not processed. Passwords are masked in every line
// it writes. See docs/idemctl.md for every command with an example.
//
// The package is a thin shell: flags and printing. What a command reads and
// changes is written once in internal/ops, which the web console of
// `idemctl serve` (internal/console: its handlers, templates and assets)
// calls too; internal/redact masks the secrets in both.
package main
