package main

import (
	"strings"
	"testing"

	"github.com/idemkit/watermill-idempotency/tests/bench"
)

func TestCompareMarkdownMatchesCellsAndNamesWhatBaseLacks(t *testing.T) {
	t.Parallel()
	head := "## Speed\n\n| workers | plain (msg/s, median) | p99 | re-read |\n|---|---|---|---|\n| 1 | 80 | 12ms | 3 |\n| 4 | 200 | 5ms | 0 |\n| 8 | 300 | 4ms | 0 |\n\n## New\n\n| a | b (msg/s) |\n|---|---|\n| x | 5 |\n"
	base := "## Speed\n\n| workers | plain (msg/s, median) | p99 |\n|---|---|---|\n| 1 | 100 | 10ms |\n| 4 | 200 | 5ms |\n"
	var runs []compareRun
	for r := range 2 {
		runs = append(runs,
			compareRun{head: true, round: r, filter: "speed", report: bench.ParseReport(head)},
			compareRun{head: false, round: r, filter: "speed", report: bench.ParseReport(base)},
			compareRun{head: true, round: r, filter: "gone", report: bench.ParseReport(head)},
			compareRun{head: false, round: r, filter: "gone", report: bench.ParseReport("")})
	}
	md := compareMarkdown(compareConfig{base: "abc", filters: []string{"speed", "gone"}, rounds: 2, inner: 1}, "head", "abc", "1 1 1", runs)
	for _, want := range []string{
		"| 0 | 1 | plain (msg/s, median) | 80 (80–80) | 100 (100–100) | 0.80 (0.80–0.80) | **slower** |",
		"| 0 | 1 | p99 | 12ms (12–12) | 10ms (10–10) | 1.20 (1.20–1.20) | **worse** |",
		"| 0 | 4 | plain (msg/s, median) | 200 (200–200) | 200 (200–200) | 1.00 (1.00–1.00) |  |",
		"base printed no section for `-only gone`",
		`section "New" (-only`,
		"**Marked (2):**",
		"Rows only head printed (new, or renamed since base): 8.",
		"Columns only head printed (new since base): re-read.",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("missing %q in:\n%s", want, md)
		}
	}
	if verdict("ratio with BEGIN and claim as 2 round trips (before)", "", 1.3) != "" || verdict("ratio with BEGIN and claim as 2 round trips (before)", "", 0.5) == "" {
		t.Error("a ratio column is higher-better whatever else its header names")
	}
	if strings.Contains(md, "| 0 | 1 | workers |") {
		t.Errorf("a row's label cell compared as a figure:\n%s", md)
	}
}
