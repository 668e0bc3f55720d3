package deduplicator

import (
	"fmt"

	"github.com/idemkit/watermill-idempotency/internal/partition"
)

// Layout is the physical layout of the processed_event table.
type Layout int

const (
	// LayoutPlain is one heap table with a primary key on (event_id,
	// consumer_group) and a processed_at index over the non-v7 ids (a v7 claim
	// writes no entry in it); a [Cleaner] deletes old rows
	// in bounded batches. It accepts ids of any version.
	LayoutPlain Layout = iota
	// LayoutPartitioned RANGE-partitions the table on event_id, one partition
	// per UTC day computed from UUIDv7 timestamps, plus a DEFAULT partition
	// for ids outside every daily partition. The primary key stays (event_id,
	// consumer_group): an event always lands in the same partition, so a
	// redelivery hits the same unique index. Retention drops whole
	// partitions ([Cleaner] does it). Only UUIDv7 ids make sense here: the
	// middleware refuses AllowNonV7 with this layout.
	LayoutPartitioned
)

func (l Layout) String() string {
	switch l {
	case LayoutPlain:
		return "plain"
	case LayoutPartitioned:
		return "partitioned"
	default:
		return fmt.Sprintf("Layout(%d)", int(l))
	}
}

func (l Layout) validate(table string) error {
	switch l {
	case LayoutPlain:
		return nil
	case LayoutPartitioned:
		if len(table) > partition.MaxTableLen {
			return fmt.Errorf("LayoutPartitioned: table name %q is longer than %d bytes, too long for its partition names (%s_pYYYYMMDD)", table, partition.MaxTableLen, table)
		}
		return nil
	default:
		return fmt.Errorf("Layout: unknown layout %d", int(l))
	}
}
