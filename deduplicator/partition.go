package deduplicator

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// Layout is the physical layout of the processed_event table.
type Layout int

const (
	// LayoutPlain is one heap table with a primary key on (event_id,
	// consumer_group) and a processed_at index; a [Cleaner] deletes old rows
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

// Suffixes of the partition names: <table>_pYYYYMMDD and <table>_default.
const (
	partitionDayFormat     = "20060102"
	partitionPrefix        = "_p"
	defaultPartitionSuffix = "_default"
	// maxPartitionedTableLen keeps <table>_pYYYYMMDD within 63 bytes.
	maxPartitionedTableLen = 63 - len(partitionPrefix) - len(partitionDayFormat)
)

func (l Layout) validate(table string) error {
	switch l {
	case LayoutPlain:
		return nil
	case LayoutPartitioned:
		if len(table) > maxPartitionedTableLen {
			return fmt.Errorf("LayoutPartitioned: table name %q is longer than %d bytes, too long for its partition names (%s_pYYYYMMDD)", table, maxPartitionedTableLen, table)
		}
		return nil
	default:
		return fmt.Errorf("Layout: unknown layout %d", int(l))
	}
}

// UUIDv7Floor returns the smallest UUIDv7 whose timestamp is t, truncated to
// the millisecond: the 48-bit Unix millisecond time, version 7, variant 10,
// every random bit zero. Every UUIDv7 created at or after t sorts at or above
// it (PostgreSQL compares uuids bytewise), every UUIDv7 created before t
// sorts below it. Times before 1970 give the floor of time 0.
func UUIDv7Floor(t time.Time) uuid.UUID {
	ms := t.UnixMilli()
	if ms < 0 {
		ms = 0
	}
	if ms >= 1<<48 {
		ms = 1<<48 - 1
	}
	var u uuid.UUID
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(ms))
	copy(u[0:6], b[2:8])
	u[6] = 0x70 // version 7, rand_a = 0
	u[8] = 0x80 // variant 10, rand_b = 0
	return u
}

// uuidv7Time returns the creation time of a UUIDv7 (millisecond precision)
// and false for an id of another version.
func uuidv7Time(id uuid.UUID) (time.Time, bool) {
	if id.Version() != 7 {
		return time.Time{}, false
	}
	var b [8]byte
	copy(b[2:8], id[0:6])
	return time.UnixMilli(int64(binary.BigEndian.Uint64(b[:]))).UTC(), true
}

// PartitionBounds returns the RANGE bounds of the daily partition holding
// the UTC day of t: FROM the floor of that day's 00:00:00.000 UTC TO the
// floor of the next day's (upper bound exclusive).
func PartitionBounds(t time.Time) (from, to uuid.UUID) {
	day := utcDay(t)
	return UUIDv7Floor(day), UUIDv7Floor(day.AddDate(0, 0, 1))
}

// PartitionName returns the name of the daily partition holding the UTC day
// of t: <table>_pYYYYMMDD.
func PartitionName(table string, t time.Time) string {
	return table + partitionPrefix + utcDay(t).Format(partitionDayFormat)
}

// DefaultPartitionName returns the name of the DEFAULT partition,
// <table>_default, which holds ids outside every daily partition (far
// future, far past).
func DefaultPartitionName(table string) string { return table + defaultPartitionSuffix }

func utcDay(t time.Time) time.Time {
	t = t.UTC()
	return time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
}
