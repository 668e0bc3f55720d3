package parallel

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// runsOf are the runs of the ascending offsets.
func runsOf(offsets ...int64) []run {
	var rs []run
	for _, o := range offsets {
		if n := len(rs); n > 0 && rs[n-1].end == o {
			rs[n-1].end++
			continue
		}
		rs = append(rs, run{o, o + 1})
	}
	return rs
}

// offsetsOf is the set of the offsets of rs.
func offsetsOf(rs []run) map[int64]bool {
	if rs == nil {
		return nil
	}
	out := map[int64]bool{}
	for _, r := range rs {
		for o := r.start; o < r.end; o++ {
			out[o] = true
		}
	}
	return out
}

func TestEncodeDoneRoundTrip(t *testing.T) {
	done := runsOf(12, 13, 14, 20, 1000, 1001)
	meta := encodeDone(10, done, 2048)
	got := decodeDone(10, meta, 1024)
	require.Equal(t, done, got)
	require.Nil(t, decodeDone(11, meta, 1024), "metadata of another committed offset")
	require.Nil(t, decodeDone(10, "something else", 1024))
	require.Nil(t, decodeDone(10, commitMetadataPrefix+"10:!!", 1024))
	require.Empty(t, encodeDone(10, nil, 2048))
	require.Empty(t, encodeDone(10, done, -1))
}

// Runs that do not fit are left out, from the end.
func TestEncodeDoneTruncates(t *testing.T) {
	var done []int64
	for o := int64(1); o < 20000; o += 2 {
		done = append(done, o)
	}
	meta := encodeDone(0, runsOf(done...), 100)
	require.LessOrEqual(t, len(meta), 100)
	got := offsetsOf(decodeDone(0, meta, 1024))
	require.NotEmpty(t, got)
	for o := range got {
		require.Equal(t, int64(1), o%2)
	}
	require.True(t, got[1])
}

// A long run costs a few bytes: the done records behind a key that holds
// the committed offset fit however many they are.
func TestEncodeDoneLongRun(t *testing.T) {
	meta := encodeDone(0, []run{{1, 1_000_000}, {1_000_001, 2_000_000}}, 64)
	require.Equal(t, []run{{1, 1_000_000}, {1_000_001, 2_000_000}}, decodeDone(0, meta, 1024))
}

// Offsets at or below the committed one are never encoded: a gap below
// zero would be written as uint64(-1), and the next owner would reject the
// whole metadata.
func TestEncodeDoneNeverUnderflows(t *testing.T) {
	meta := encodeDone(5, runsOf(4, 5, 6, 7, 9), 2048)
	require.Equal(t, map[int64]bool{6: true, 7: true, 9: true}, offsetsOf(decodeDone(5, meta, 1024)))
	require.Empty(t, encodeDone(5, runsOf(3, 5), 2048))
}

// craftedRuns is commit metadata for mark of n runs, each a gap of 0 and
// the given length: about 4 KB of it named 10^8 offsets before decoding was
// bounded.
func craftedRuns(mark int64, n int, length uint64) string {
	var buf []byte
	for range n {
		buf = binary.AppendUvarint(buf, 0)
		buf = binary.AppendUvarint(buf, length)
	}
	return commitMetadataPrefix + strconv.FormatInt(mark, 10) + ":" + base64.RawURLEncoding.EncodeToString(buf)
}

// Decoding is bounded: crafted metadata yields at most limit runs (the
// window), the lowest, whatever their length; a run is two offsets in
// memory, however many records it names.
func TestDecodeDoneBoundedByWindow(t *testing.T) {
	meta := craftedRuns(0, 600, 1<<20-1) // 600 runs of 2^20-1 offsets: ~6.3e8
	require.LessOrEqual(t, len(meta), 4096)
	got := decodeDone(0, meta, 100)
	require.Len(t, got, 100)
	require.Equal(t, run{1, 1 << 20}, got[0])
	// Lengths and gaps that would overflow an offset are malformed.
	var buf []byte
	buf = binary.AppendUvarint(buf, math.MaxUint64)
	buf = binary.AppendUvarint(buf, 1)
	require.Nil(t, decodeDone(0, commitMetadataPrefix+"0:"+base64.RawURLEncoding.EncodeToString(buf), 1024))
	require.Nil(t, decodeDone(0, craftedRuns(0, 1, math.MaxInt64), 1024))
}

// FuzzDecodeDone holds the decoder to its bounds on any metadata: at most
// limit runs, ascending, not empty, all above the mark, and what encodeDone
// writes reads back.
func FuzzDecodeDone(f *testing.F) {
	f.Add(int64(10), encodeDone(10, runsOf(12, 13, 14, 20, 1000, 1001), 2048), 1024)
	f.Add(int64(0), craftedRuns(0, 600, 1<<20-1), 1024)
	f.Add(int64(0), craftedRuns(0, 3, math.MaxInt64), 16)
	f.Add(int64(7), commitMetadataPrefix+"7:AAAA", 1)
	f.Add(int64(7), commitMetadataPrefix+"7:", 4)
	f.Add(int64(-1), commitMetadataPrefix+"-1:AQE", 4)
	f.Add(int64(0), "something else", 4)
	f.Fuzz(func(t *testing.T, mark int64, meta string, limit int) {
		limit %= 1 << 16
		got := decodeDone(mark, meta, limit)
		require.LessOrEqual(t, len(got), max(limit, 0))
		prev := mark
		for _, r := range got {
			require.Greater(t, r.start, prev)
			require.Greater(t, r.end, r.start)
			prev = r.end - 1
		}
		if got == nil || mark < 0 || limit <= 0 || !strings.HasPrefix(meta, commitMetadataPrefix) {
			return
		}
		// Re-encoding what was read gives the same runs (adjacent ones
		// merged), when it fits.
		again := encodeDone(mark, got, 1<<20)
		require.Equal(t, merged(got), merged(decodeDone(mark, again, limit)))
	})
}

// merged is rs with adjacent runs joined; empty for none.
func merged(rs []run) []run {
	out := []run{}
	for _, r := range rs {
		if n := len(out); n > 0 && out[n-1].end == r.start {
			out[n-1].end = r.end
			continue
		}
		out = append(out, r)
	}
	return out
}
