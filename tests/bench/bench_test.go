package bench

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestInterleaveRunsEveryVariant(t *testing.T) {
	t.Parallel()
	var calls [3]atomic.Int64
	ops := make([]func(context.Context) error, 3)
	for i := range ops {
		ops[i] = func(context.Context) error { calls[i].Add(1); time.Sleep(time.Millisecond); return nil }
	}
	rates, err := Interleave(context.Background(), 2, 3, 30*time.Millisecond, ops...)
	require.NoError(t, err)
	require.Len(t, rates, 3)
	for i := range rates {
		require.Len(t, rates[i], 2, "one rate per round")
		require.Positive(t, calls[i].Load())
		for _, r := range rates[i] {
			require.Positive(t, r)
		}
	}
}

func TestInterleaveReturnsFirstError(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	_, err := Interleave(context.Background(), 1, 2, time.Second,
		func(context.Context) error { return nil },
		func(context.Context) error { return boom })
	require.ErrorIs(t, err, boom)
}

func TestSummariseAndRatios(t *testing.T) {
	t.Parallel()
	require.Equal(t, Stats{Median: 2, Min: 1, Max: 3}, Summarise([]float64{3, 1, 2}))
	require.Equal(t, Stats{Median: 2.5, Min: 1, Max: 4}, Summarise([]float64{4, 1, 3, 2}))
	require.Equal(t, []float64{2, 0.5}, Ratios([]float64{1, 4, 0}, []float64{2, 2, 5}))
}

func TestRotateRunsEveryVariantEachRound(t *testing.T) {
	t.Parallel()
	var order []int
	variant := func(i int) func() (float64, error) {
		return func() (float64, error) { order = append(order, i); return float64(i + 1), nil }
	}
	rates, err := Rotate(3, variant(0), variant(1), variant(2))
	require.NoError(t, err)
	require.Equal(t, [][]float64{{1, 1, 1}, {2, 2, 2}, {3, 3, 3}}, rates)
	require.Equal(t, []int{0, 1, 2, 1, 2, 0, 2, 0, 1}, order)

	boom := errors.New("boom")
	_, err = Rotate(2, variant(0), func() (float64, error) { return 0, boom })
	require.ErrorIs(t, err, boom)
}
