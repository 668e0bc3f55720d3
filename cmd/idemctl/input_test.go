package main_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

func TestUsage(t *testing.T) {
	t.Parallel()
	r := run(t, nil, "--help")
	require.Equal(t, 0, r.Code, r)
	require.Contains(t, r.Stdout, "dedup check")
	require.Contains(t, r.Stdout, "Exit codes:")
	r = run(t, nil)
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stdout, "Usage: idemctl")
	r = run(t, nil, "dedup", "check", "-h")
	require.Equal(t, 0, r.Code, r)
	require.Contains(t, r.Stdout, "Usage: idemctl dedup check EVENT_ID [--group G]...")
	require.Contains(t, r.Stdout, "-group")
	r = run(t, nil, "dedup")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stdout, "idemctl dedup stats")
	r = run(t, nil, "frobnicate")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stderr, `unknown command "frobnicate"`)
	r = run(t, nil, "dedup", "frobnicate")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stderr, `unknown command "dedup frobnicate"`)
	r = run(t, nil, "dedup", "stats")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stderr, "no database: set DATABASE_URL or pass --database-url")
}

// Flags may come before the command or after it, and flags override the
// environment.
func TestFlagsAnywhere(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	r := run(t, []string{"DATABASE_URL=postgres://nobody@127.0.0.1:1/none"}, "--database-url", db.URL, "--schema", db.Schema, "--json", "retention", "show")
	require.Equal(t, 0, r.Code, r)
	require.Contains(t, r.Stdout, `"retention_seconds": 604800`)
	r = run(t, nil, "retention", "--database-url", db.URL, "show") // a flag between the names is not allowed
	require.Equal(t, 2, r.Code, r)
}

// A password in DATABASE_URL, --database-url or a key=value connection
// string never reaches stdout or stderr: not in errors (unreachable server,
// malformed URL, missing table) and not in --json output.
func TestCredentialsNeverPrinted(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	const pw = "s3cr3t-Pa55"
	withPW := strings.Replace(db.URL, "postgres://postgres@", "postgres://postgres:"+pw+"@", 1)
	require.NotEqual(t, db.URL, withPW)
	encoded := strings.Replace(db.URL, "postgres://postgres@", "postgres://postgres:p%40ss%2Fw0rd@", 1)
	cases := []struct {
		name string
		env  []string
		args []string
		code int
	}{
		{"unreachable, env", []string{"DATABASE_URL=postgres://postgres:" + pw + "@127.0.0.1:1/test?sslmode=disable&connect_timeout=5"}, []string{"dedup", "stats"}, 1},
		{"unreachable, flag", nil, []string{"dedup", "stats", "--json", "--database-url", "postgres://postgres:" + pw + "@127.0.0.1:1/test?connect_timeout=5"}, 1},
		{"unreachable, key=value", []string{"DATABASE_URL=host=127.0.0.1 port=1 user=postgres password=" + pw + " connect_timeout=5"}, []string{"groups", "list"}, 1},
		{"malformed URL", []string{"DATABASE_URL=postgres://postgres:" + pw + "@127.0.0.1:notaport/test"}, []string{"dedup", "stats"}, 2},
		{"missing table", []string{"DATABASE_URL=" + withPW}, []string{"dedup", "stats", "--json", "--schema", db.Schema}, 1},
		{"works, json", []string{"DATABASE_URL=" + withPW}, []string{"migrate", "status", "--json", "--schema", db.Schema}, 0},
		{"works, human", []string{"DATABASE_URL=" + withPW}, []string{"migrate", "up", "--schema", db.Schema}, 0},
		{"url-encoded password", []string{"DATABASE_URL=" + encoded}, []string{"migrate", "status", "--schema", db.Schema, "--table", "bad name"}, 2},
		{"url-encoded password, unreachable", []string{"DATABASE_URL=postgres://postgres:p%40ss%2Fw0rd@127.0.0.1:1/test?connect_timeout=5"}, []string{"dedup", "stats"}, 1},
	}
	for _, c := range cases {
		r := run(t, c.env, c.args...)
		require.Equal(t, c.code, r.Code, "%s: %s", c.name, r)
		for _, secret := range []string{pw, "p%40ss%2Fw0rd", "p@ss/w0rd"} {
			require.NotContains(t, r.Stdout, secret, c.name)
			require.NotContains(t, r.Stderr, secret, c.name)
		}
		if c.code != 0 && slices.Contains(c.args, "--json") {
			require.Contains(t, r.Stdout, `"error"`, c.name) // --json: the error is a document on stdout
		} else if c.code != 0 {
			require.NotEmpty(t, r.Stderr, c.name)
		}
	}
}

func TestPoisonFlags(t *testing.T) {
	t.Parallel()
	env := []string{"KAFKA_BROKERS=127.0.0.1:1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"poison", "list"}, "--topic (the poison topic) is required"},
		{[]string{"poison", "list", "--topic", "p", "--since", "yesterday"}, "--since"},
		{[]string{"poison", "list", "--topic", "p", "--since", "1h", "--until", "2h"}, "--since must be before --until"},
		{[]string{"poison", "replay", "--topic", "p", "--event-id", "nope"}, `invalid event id "nope"`},
		{[]string{"poison", "replay", "--topic", "p", "--reason-exact"}, "--reason-exact needs --reason"},
		{[]string{"poison", "replay", "--topic", "p", "--rate", "-1"}, "--rate must not be negative"},
		{[]string{"poison", "replay", "--topic", "p", "--rate", "NaN"}, "--rate must not be negative"},
		{[]string{"poison", "list", "--topic", "p", "--limit", "-1"}, "--limit must not be negative"},
		{[]string{"poison", "list", "--topic", "p", "--dry-run"}, "flag provided but not defined: -dry-run"},
	} {
		r := run(t, env, c.args...)
		require.Equal(t, 2, r.Code, r)
		require.Contains(t, r.Stderr, c.want)
	}
	r := run(t, nil, "poison", "list", "--topic", "p")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stderr, "no Kafka brokers")
	// Valid flags reach the brokers (here none listens).
	r = run(t, env, "poison", "replay", "--topic", "p", "--reason", "timeout", "--since", "2026-01-01T00:00:00Z", "--event-id", "0190a5d0-ac96-774b-bcce-b302099a8057", "--dry-run", "--rate", "10")
	require.Equal(t, 1, r.Code, r)
	require.Contains(t, r.Stderr, "poison: connect")
}
