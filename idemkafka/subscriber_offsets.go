package idemkafka

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strconv"
	"strings"
)

// commitMetadataPrefix starts the offset commit metadata the Subscriber
// writes: the version, the committed offset it belongs to, and the offsets
// above it that are already done.
const commitMetadataPrefix = "idemkafka1:"

// encodeDone returns the commit metadata for committed offset mark and the
// done offsets above it (ascending, all > mark): "idemkafka1:<mark>:<runs>",
// runs being base64 (raw URL) of uvarint pairs (gap, length): the first run
// starts gap offsets after mark, each next one gap offsets after the end of
// the previous one. Runs that would make the metadata longer than maxLen
// are left out (those offsets run again after a restart, and their claims
// make that harmless). It returns "" when nothing above mark is done or
// maxLen leaves no room.
func encodeDone(mark int64, done []int64, maxLen int) string {
	if len(done) == 0 || maxLen <= 0 {
		return ""
	}
	head := commitMetadataPrefix + strconv.FormatInt(mark, 10) + ":"
	room := base64.RawURLEncoding.DecodedLen(maxLen - len(head))
	if room <= 0 {
		return ""
	}
	var buf []byte
	var tmp [2 * binary.MaxVarintLen64]byte
	prevEnd := mark + 1 // first offset after the previous run (mark itself is never done)
	for len(done) > 0 && done[0] < prevEnd {
		done = done[1:] // not above mark: a gap would underflow
	}
	for i := 0; i < len(done); {
		start := done[i]
		j := i + 1
		for j < len(done) && done[j] == done[j-1]+1 {
			j++
		}
		n := binary.PutUvarint(tmp[:], uint64(start-prevEnd))
		n += binary.PutUvarint(tmp[n:], uint64(j-i))
		if len(buf)+n > room {
			break
		}
		buf = append(buf, tmp[:n]...)
		prevEnd = start + int64(j-i)
		i = j
	}
	if len(buf) == 0 {
		return ""
	}
	return head + base64.RawURLEncoding.EncodeToString(buf)
}

// decodeDone reads commit metadata written by encodeDone for committed
// offset mark: the set of done offsets above it, at most limit of them
// (the lowest; a window of limit records from mark on cannot hold more, and
// what is left out runs again), so that crafted metadata cannot make a
// member allocate more than its PartitionWindow. Metadata of another
// offset, of another writer, or malformed gives nil: the records run again
// and their claims settle them.
func decodeDone(mark int64, meta string, limit int) map[int64]bool {
	if limit <= 0 || mark < 0 {
		return nil
	}
	rest, ok := strings.CutPrefix(meta, commitMetadataPrefix)
	if !ok {
		return nil
	}
	base, runs, ok := strings.Cut(rest, ":")
	if !ok || base != strconv.FormatInt(mark, 10) {
		return nil
	}
	buf, err := base64.RawURLEncoding.DecodeString(runs)
	if err != nil {
		return nil
	}
	done := map[int64]bool{}
	prevEnd := mark + 1
	for len(buf) > 0 && len(done) < limit {
		gap, n := binary.Uvarint(buf)
		if n <= 0 {
			return nil
		}
		buf = buf[n:]
		length, n := binary.Uvarint(buf)
		if n <= 0 || length == 0 || gap > math.MaxInt64-uint64(prevEnd) {
			return nil
		}
		buf = buf[n:]
		start := prevEnd + int64(gap)
		if length > math.MaxInt64-uint64(start) {
			return nil
		}
		end := start + int64(length)
		for o := start; o < end && len(done) < limit; o++ {
			done[o] = true
		}
		prevEnd = end
	}
	return done
}
