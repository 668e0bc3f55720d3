package main_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type errorJSON struct {
	Error string `json:"error"`
	Code  int    `json:"code"`
}

// Durations are parsed with overflow checks: a day count too large for a
// time.Duration exits 2 and changes nothing (it used to wrap around:
// 213504d set 25m26s).
func TestDurationsOverflow(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	for _, d := range []string{"213504d", "106752d", "9223372037s", "99999999999999999999d"} {
		fails(t, db, 2, "retention", "retention", "set", d, "--yes", "--force")
	}
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 7d")
	fails(t, db, 2, "--retention", "migrate", "up", "--retention", "213504d")
	fails(t, db, 2, "--since", "poison", "list", "--topic", "t", "--since", "213504d")
	ok(t, db, "retention", "set", "106751d") // the longest whole-day value
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 106751d")
}

// A retention at or below the consumers' default StaleMargin (1h) would make
// every consumer refuse to start: refused without --force, saying so.
func TestRetentionWithinStaleMarginNeedsForce(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	for _, d := range []string{"30m", "1h"} {
		r := fails(t, db, 2, "every consumer that keeps the default refuses to start", "retention", "set", d, "--yes")
		require.Contains(t, r.Stderr, "--force")
	}
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 7d")
	ok(t, db, "retention", "set", "61m", "--yes")
	ok(t, db, "retention", "set", "30m", "--yes", "--force")
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 30m0s")

	fresh := migrated(t, "plain", "orders")
	fails(t, fresh, 2, "refuses to start", "migrate", "up", "--retention", "45m")
}

// With --json an error is a JSON document on stdout, {"error", "code"},
// with the exit code unchanged: bad input (2), a failure (1), a bad flag
// met while parsing.
func TestJSONErrors(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"--json", "retention", "set", "213504d", "--yes"}, 2, "too long"},
		{[]string{"dedup", "check", "not-a-uuid", "--json"}, 2, "invalid event id"},
		{[]string{"dedup", "check", v7At(time.Now()).String(), "--json", "--table", "nope"}, 1, "does not exist"},
		{[]string{"--json", "dedup", "check", "--frobnicate"}, 2, "frobnicate"},
		{[]string{"--json=true", "groups", "forget", "billing"}, 2, "unknown consumer group"},
	} {
		r := ctl(t, db, tc.args...)
		require.Equal(t, tc.code, r.Code, r)
		require.Empty(t, r.Stderr, r)
		e := decode[errorJSON](t, r)
		require.Equal(t, tc.code, e.Code, r)
		require.Contains(t, e.Error, tc.msg, r)
	}
	// Without --json the error stays text on stderr.
	r := fails(t, db, 2, "too long", "retention", "set", "213504d", "--yes")
	require.Empty(t, r.Stdout)
}

// An empty --group is refused rather than meaning every group.
func TestEmptyGroupRefused(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	id := v7At(time.Now())
	claim(t, db, "billing", true, id)
	for _, g := range []string{"", ",", "billing,"} {
		fails(t, db, 2, "-group", "dedup", "check", id.String(), "--group", g)
	}
	fails(t, db, 2, "-event-id", "poison", "list", "--topic", "t", "--event-id", "")
}

// A missing companion table is named, not the processed_event table.
func TestMissingTableNamed(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	db.Exec(t, "DROP TABLE processed_event_group")
	r := fails(t, db, 1, "table "+db.Schema+".processed_event_group does not exist (run idemctl migrate up", "groups", "list")
	require.NotContains(t, r.Stderr, "processed_event table does not exist")
	fails(t, db, 1, "processed_event_group does not exist", "dedup", "check", v7At(time.Now()).String())
}
