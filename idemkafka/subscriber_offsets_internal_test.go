package idemkafka

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEncodeDoneRoundTrip(t *testing.T) {
	done := []int64{12, 13, 14, 20, 1000, 1001}
	meta := encodeDone(10, done, 2048)
	got := decodeDone(10, meta, 1024)
	want := map[int64]bool{}
	for _, o := range done {
		want[o] = true
	}
	require.Equal(t, want, got)
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
	meta := encodeDone(0, done, 100)
	require.LessOrEqual(t, len(meta), 100)
	got := decodeDone(0, meta, 1024)
	require.NotEmpty(t, got)
	for o := range got {
		require.Equal(t, int64(1), o%2)
	}
	require.True(t, got[1])
}

// Offsets at or below the committed one are never encoded: a gap below
// zero would be written as uint64(-1), and the next owner would reject the
// whole metadata.
func TestEncodeDoneNeverUnderflows(t *testing.T) {
	meta := encodeDone(5, []int64{4, 5, 6, 7, 9}, 2048)
	require.Equal(t, map[int64]bool{6: true, 7: true, 9: true}, decodeDone(5, meta, 1024))
	require.Empty(t, encodeDone(5, []int64{3, 5}, 2048))
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

// Decoding is bounded by the window: crafted metadata of about 4 KB that
// names 10^8 done offsets yields at most PartitionWindow of them, the
// lowest.
func TestDecodeDoneBoundedByWindow(t *testing.T) {
	meta := craftedRuns(0, 600, 1<<20-1) // 600 runs of 2^20-1 offsets: ~6.3e8
	require.LessOrEqual(t, len(meta), 4096)
	got := decodeDone(0, meta, 1024)
	require.Len(t, got, 1024)
	for o := int64(1); o <= 1024; o++ {
		require.True(t, got[o])
	}
	// Lengths and gaps that would overflow an offset are malformed.
	var buf []byte
	buf = binary.AppendUvarint(buf, math.MaxUint64)
	buf = binary.AppendUvarint(buf, 1)
	require.Nil(t, decodeDone(0, commitMetadataPrefix+"0:"+base64.RawURLEncoding.EncodeToString(buf), 1024))
	require.Nil(t, decodeDone(0, craftedRuns(0, 1, math.MaxInt64), 1024))
}

// FuzzDecodeDone holds the decoder to its bounds on any metadata: at most
// limit offsets, all above the mark, and what encodeDone writes reads back.
func FuzzDecodeDone(f *testing.F) {
	f.Add(int64(10), encodeDone(10, []int64{12, 13, 14, 20, 1000, 1001}, 2048), 1024)
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
		for o := range got {
			require.Greater(t, o, mark)
		}
		if got == nil || mark < 0 || limit <= 0 || !strings.HasPrefix(meta, commitMetadataPrefix) {
			return
		}
		// Re-encoding what was read gives the same set, when it fits.
		var done []int64
		for o := range got {
			done = append(done, o)
		}
		slices.Sort(done)
		again := encodeDone(mark, done, 1<<20)
		require.Equal(t, got, nonNil(decodeDone(mark, again, limit)))
	})
}

// nonNil makes an empty result comparable with decodeDone's empty map.
func nonNil(m map[int64]bool) map[int64]bool {
	if m == nil {
		return map[int64]bool{}
	}
	return m
}
