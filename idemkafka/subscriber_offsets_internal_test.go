package idemkafka

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEncodeDoneRoundTrip(t *testing.T) {
	done := []int64{12, 13, 14, 20, 1000, 1001}
	meta := encodeDone(10, done, 2048)
	got := decodeDone(10, meta)
	want := map[int64]bool{}
	for _, o := range done {
		want[o] = true
	}
	require.Equal(t, want, got)
	require.Nil(t, decodeDone(11, meta), "metadata of another committed offset")
	require.Nil(t, decodeDone(10, "something else"))
	require.Nil(t, decodeDone(10, commitMetadataPrefix+"10:!!"))
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
	got := decodeDone(0, meta)
	require.NotEmpty(t, got)
	for o := range got {
		require.Equal(t, int64(1), o%2)
	}
	require.True(t, got[1])
}
