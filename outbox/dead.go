package outbox

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// RowError is a message the outbox refuses, or a row the forwarder cannot
// send: at write time it is returned to the writer (and, from a dedup
// handler, it is permanent: publisher.ErrMessageTooLarge and
// publisher.ErrReservedMetadata are among the middleware's IsPermanent
// sentinels, so the poison queue takes the incoming message); at forward
// time it is the cause logged when the row moves to the dead table.
type RowError struct {
	Topic string
	// Offset is the row's "offset" (0 at write time: not written).
	Offset int64
	UUID   string
	// Key is the partition key, "" when none.
	Key string
	// Size is the size of the Kafka record it makes (0: not built).
	Size int
	// Err is the cause: wraps publisher.ErrMessageTooLarge or
	// publisher.ErrReservedMetadata, or tells why the row is unreadable.
	Err error
}

func (e *RowError) Error() string {
	s := "outbox: topic " + e.Topic
	if e.Offset != 0 {
		s += ", row " + strconv.FormatInt(e.Offset, 10)
	}
	s += ", message " + e.UUID
	if e.Key != "" {
		s += ", key " + strconv.Quote(e.Key)
	}
	if e.Size > 0 {
		s += ", " + strconv.Itoa(e.Size) + " bytes"
	}
	return s + ": " + e.Err.Error()
}

func (e *RowError) Unwrap() error { return e.Err }

// DeadRow is a row of a topic's dead table: a row the forwarder could not
// send (Cause says why; HeldBehind is 0), or a later row of its partition
// key that waits behind it (HeldBehind is the ID of the row it waits
// behind).
type DeadRow struct {
	// ID orders a topic's dead rows; a key's rows are retried in it.
	ID int64
	// Offset, UUID, CreatedAt, Payload and Metadata are the row as it
	// stood in the messages table (Metadata as its JSON).
	Offset    int64
	UUID      string
	CreatedAt time.Time
	Payload   []byte
	Metadata  []byte
	// Key is the row's partition_key metadata, "" when none.
	Key        string
	Cause      string
	HeldBehind int64
	// Size is the size of its Kafka record, 0 when none was built.
	Size          int
	QuarantinedAt time.Time
}

// DeadRows lists topic's dead rows in order, at most limit (≤ 0: all).
// Rows land there when the forwarder cannot send them (a record over its
// MaxMessageBytes, metadata that is unreadable or holds a reserved key),
// followed by the later rows of their partition keys, which wait behind
// them so that a key's order is kept; the rest of the topic goes on. Fix
// the cause (raise the producer's limit, ...) and [Outbox.RetryDead] the
// key, or [Outbox.DropDead] the poison row and then retry the key to send
// the rows held behind it. idemctl outbox dead list/retry/drop does the
// same.
func (o *Outbox) DeadRows(ctx context.Context, db migrate.DBTX, topic string, limit int) ([]DeadRow, error) {
	if err := o.cfg.validateTopic(topic); err != nil {
		return nil, err
	}
	rows, err := o.tables(topic).DeadRows(ctx, db, nil, limit)
	if err != nil {
		return nil, fmt.Errorf("outbox: dead rows of %s: %w", topic, err)
	}
	out := make([]DeadRow, len(rows))
	for i, r := range rows {
		out[i] = DeadRow{ID: r.ID, Offset: r.Offset, UUID: r.UUID, CreatedAt: r.CreatedAt, Payload: r.Payload, Metadata: r.Metadata,
			Key: r.Key, Cause: r.Cause, HeldBehind: r.HeldBehind, Size: r.Size, QuarantinedAt: r.QuarantinedAt}
	}
	return out, nil
}

// RetryDead moves the dead rows of key back into topic's messages table, in
// their order, in one transaction on db, and returns how many: the
// forwarder sends them like new rows (new offsets; the same message UUID,
// payload and metadata, so a dedup consumer applies each once). A row that
// still cannot be sent comes back to the dead table, with the rest of the
// key behind it. The key "" retries the rows without a partition key. It
// returns an error wrapping [ErrKeyPending], and moves nothing, while a row of the key
// waits unread in the messages table.
func (o *Outbox) RetryDead(ctx context.Context, db migrate.Beginner, topic, key string) (int64, error) {
	if err := o.cfg.validateTopic(topic); err != nil {
		return 0, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("outbox: retry dead rows: begin: %w", err)
	}
	defer rollback(ctx, tx)
	n, err := o.tables(topic).RetryDead(ctx, tx, key)
	if err != nil {
		return 0, fmt.Errorf("outbox: retry dead rows of %s key %q: %w", topic, key, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("outbox: retry dead rows: commit: %w", err)
	}
	wakers.wake(o.MessagesTable(topic))
	return n, nil
}

// DropDead deletes topic's dead row id (its message is never sent) and
// reports whether it was there. The rows held behind it stay in the dead
// table, and keep their key held, until their key is retried
// ([Outbox.RetryDead]) or they are dropped too.
func (o *Outbox) DropDead(ctx context.Context, db migrate.DBTX, topic string, id int64) (bool, error) {
	if err := o.cfg.validateTopic(topic); err != nil {
		return false, err
	}
	ok, err := o.tables(topic).DropDead(ctx, db, id)
	if err != nil {
		return false, fmt.Errorf("outbox: drop dead row %d of %s: %w", id, topic, err)
	}
	return ok, nil
}
