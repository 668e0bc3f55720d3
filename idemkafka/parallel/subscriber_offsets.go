package parallel

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

// run is the offsets start..end-1.
type run struct{ start, end int64 }

// encodeDone returns the commit metadata for committed offset mark and the
// runs of done offsets above it (ascending, not overlapping, all > mark):
// "idemkafka1:<mark>:<runs>", runs being base64 (raw URL) of uvarint pairs
// (gap, length): the first run starts gap offsets after mark, each next one
// gap offsets after the end of the previous one. Runs that would make the
// metadata longer than maxLen are left out (those offsets run again after
// a restart, and their claims make that harmless). It returns "" when
// nothing above mark is done or maxLen leaves no room.
func encodeDone(mark int64, done []run, maxLen int) string {
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
	for _, r := range done {
		r.start = max(r.start, prevEnd) // not above mark, or overlapping: a gap would underflow
		if r.end <= r.start {
			continue
		}
		n := binary.PutUvarint(tmp[:], uint64(r.start-prevEnd))
		n += binary.PutUvarint(tmp[n:], uint64(r.end-r.start))
		if len(buf)+n > room {
			break
		}
		buf = append(buf, tmp[:n]...)
		prevEnd = r.end
	}
	if len(buf) == 0 {
		return ""
	}
	return head + base64.RawURLEncoding.EncodeToString(buf)
}

// decodeDone reads commit metadata written by encodeDone for committed
// offset mark: the runs of done offsets above it, at most limit runs (the
// lowest; what is left out runs again), so that crafted metadata cannot
// make a member allocate more than that. Metadata of another offset, of
// another writer, or malformed gives nil: the records run again and their
// claims settle them.
func decodeDone(mark int64, meta string, limit int) []run {
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
	var done []run
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
		done = append(done, run{start, end})
		prevEnd = end
	}
	if done == nil {
		done = []run{}
	}
	return done
}
