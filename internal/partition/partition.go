// Package partition is the arithmetic of the processed_event table's daily
// partitions: RANGE bounds on event_id computed from UUIDv7 times, the
// partitions' names, whether a table is partitioned and its partitions as
// the catalog lists them.
package partition

import (
	"encoding/binary"
	"time"

	"github.com/google/uuid"
)

// Suffixes of the partition names: <table>_pYYYYMMDD and <table>_default.
const (
	DayFormat     = "20060102"
	Prefix        = "_p"
	DefaultSuffix = "_default"
	// MaxTableLen keeps <table>_pYYYYMMDD within 63 bytes.
	MaxTableLen = 63 - len(Prefix) - len(DayFormat)
)

// Floor returns the smallest UUIDv7 whose timestamp is t, truncated to
// the millisecond: the 48-bit Unix millisecond time, version 7, variant 10,
// every random bit zero. Every UUIDv7 created at or after t sorts at or above
// it (PostgreSQL compares uuids bytewise), every UUIDv7 created before t
// sorts below it. Times before 1970 give the floor of time 0.
func Floor(t time.Time) uuid.UUID {
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

// Time returns the creation time of a UUIDv7 (millisecond precision)
// and false for an id of another version.
func Time(id uuid.UUID) (time.Time, bool) {
	if id.Version() != 7 {
		return time.Time{}, false
	}
	var b [8]byte
	copy(b[2:8], id[0:6])
	return time.UnixMilli(int64(binary.BigEndian.Uint64(b[:]))).UTC(), true
}

// Bounds returns the RANGE bounds of the daily partition holding
// the UTC day of t: FROM the floor of that day's 00:00:00.000 UTC TO the
// floor of the next day's (upper bound exclusive).
func Bounds(t time.Time) (from, to uuid.UUID) {
	day := UTCDay(t)
	return Floor(day), Floor(day.AddDate(0, 0, 1))
}

// Name returns the name of the daily partition holding the UTC day
// of t: <table>_pYYYYMMDD.
func Name(table string, t time.Time) string {
	return table + Prefix + UTCDay(t).Format(DayFormat)
}

// DefaultName returns the name of the DEFAULT partition,
// <table>_default, which holds ids outside every daily partition (far
// future, far past).
func DefaultName(table string) string { return table + DefaultSuffix }

// UTCDay is the start of t's UTC day.
func UTCDay(t time.Time) time.Time {
	t = t.UTC()
	return time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
}
