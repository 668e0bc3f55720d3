// Package outboxsql holds every statement the module runs on the outbox
// tables besides watermill-sql's own (its INSERT of messages and its CREATE
// TABLEs): the forwarder's registration, position lock, batch reads and
// position update, the backlog, the deletion of forwarded rows, the
// operator's reposition (idemctl outbox reposition) and the read of a
// topic's messages for idemtest. It is the one place that knows the
// columns of the tables:
//
//	messages: "offset" BIGSERIAL, uuid, created_at, payload, metadata (JSON),
//	          transaction_id xid8 (the writer's pg_current_xact_id()),
//	          PRIMARY KEY (transaction_id, "offset")
//	offsets:  consumer_group PRIMARY KEY, offset_acked BIGINT,
//	          last_processed_transaction_id xid8 (watermill-sql v4's),
//	          position_snapshot, cut_snapshot pg_snapshot, cut_offset BIGINT
//	          (the forwarder's, migration 2), position_system_identifier
//	          BIGINT, position_xmax xid8 (the position's [Origin], migration 3)
//	dead:     id BIGSERIAL, the messages columns, partition_key, cause,
//	          held_behind, size, quarantined_at (migration 4, see dead.go)
//
// A forwarder's row of the offsets table is a [Position]: a snapshot, so
// that rows are forwarded in batches cut between two snapshots (PgQ's
// rule): a cut is the rows whose writing transaction is visible in the
// current snapshot and not in the previous one, in "offset" order. A
// watermill-sql subscriber's row (consumer_group = its consumer group) has
// only the watermill-sql columns; [Position] reads them too.
//
// Every statement works in all of pgx's query exec modes (the simple
// protocol included): snapshots travel as text, transaction ids as
// integers, each with an explicit cast.
package outboxsql

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Tables are one topic's messages and offsets tables, quoted and
// schema-qualified.
type Tables struct {
	Messages, Offsets string
	// Dead holds the topic's poison rows (see dead.go).
	Dead string
}

// OffsetsSuffix names a topic's offsets table, DeadSuffix its table of
// poison rows (shorter: whatever fits the first fits the second).
const (
	OffsetsSuffix = "__offsets"
	DeadSuffix    = "__dead"
)

// TopicTables returns the tables of topic in an outbox configured with
// schema and prefix (outbox.Config's Schema and TablePrefix).
func TopicTables(schema, prefix, topic string) Tables {
	return Tables{
		Messages: ident.Quote(schema, prefix+topic),
		Offsets:  ident.Quote(schema, prefix+topic+OffsetsSuffix),
		Dead:     ident.Quote(schema, prefix+topic+DeadSuffix),
	}
}

// Row is a row of a messages table.
type Row struct {
	// TxID is the writing transaction's id (transaction_id).
	TxID uint64
	// Offset is the row's "offset", its place in insertion order.
	Offset   int64
	UUID     string
	Payload  []byte
	Metadata []byte // a JSON object, or nil
}

// Message returns the row as a Watermill message, its metadata decoded.
func (r Row) Message() (*message.Message, error) {
	msg := message.NewMessage(r.UUID, r.Payload)
	if r.Metadata != nil {
		md, err := decodeMetadata(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("outbox row (%d, %d) metadata: %w", r.TxID, r.Offset, err)
		}
		msg.Metadata = md
	}
	return msg, nil
}
