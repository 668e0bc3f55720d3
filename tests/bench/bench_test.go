package bench

import (
	"context"
	"errors"
	"os"
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
	// Each round must see a call of every variant: half a second, not the
	// 30 ms it once was, which a loaded machine did not always schedule.
	rates, err := Interleave(context.Background(), 2, 3, 500*time.Millisecond, ops...)
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

func TestParseReport(t *testing.T) {
	t.Parallel()
	md := "# Benchmarks\n\n- date: 2026-12-01T23:49:25Z\n- CPUs: 2 (linux/amd64), load average at start: 9.19 12.58 11.62\n- mode: full, 5 rounds\n\n" +
		"## Dedup overhead\n\n| workers | plain | ratio |\n|---|---|---|\n| 1 | 2254 | 0.92 (0.87–0.97) |\n\ntext\n\n" +
		"| mode | p99 added |\n|---|---|\n| group, defaults | −67µs |\n"
	r := ParseReport(md)
	require.Equal(t, "2026-12-01T23:49:25Z", r.Generated)
	require.Equal(t, "full", r.Mode)
	require.Equal(t, "9.19 12.58 11.62", r.Load)
	require.Len(t, r.Cells, 5)
	ratio := r.Cells[2]
	require.Equal(t, "Dedup overhead", ratio.Section)
	require.Equal(t, "1", ratio.Row)
	require.Equal(t, "ratio", ratio.Column)
	require.Equal(t, 0.92, *ratio.Median)
	require.Equal(t, 0.87, *ratio.Min)
	require.Equal(t, 0.97, *ratio.Max)
	added := r.Cells[4]
	require.Equal(t, 1, added.Table)
	require.Equal(t, "group, defaults", added.Row)
	require.Equal(t, -67.0, *added.Median)
	require.Equal(t, "µs", added.Unit)
	require.Nil(t, r.Cells[3].Median, "a label is not a figure")
}

// TestBenchmarksJSONMatchesTheReport keeps docs/benchmarks.json in step with
// docs/benchmarks.md: make bench writes both; a hand edit of one fails here.
func TestBenchmarksJSONMatchesTheReport(t *testing.T) {
	t.Parallel()
	md, err := os.ReadFile("../../docs/benchmarks.md")
	require.NoError(t, err)
	want, err := ParseReport(string(md)).JSON()
	require.NoError(t, err)
	got, err := os.ReadFile("../../docs/benchmarks.json")
	require.NoError(t, err)
	require.Equal(t, string(want), string(got), "docs/benchmarks.json is stale: run make bench, or go run ./cmd/bench -json-from docs/benchmarks.md -json docs/benchmarks.json")
}
