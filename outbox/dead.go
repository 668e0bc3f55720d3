package outbox

import (
	"strconv"
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
