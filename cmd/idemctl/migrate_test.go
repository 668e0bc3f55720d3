package main_test

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

type statusJSON struct {
	Versions []struct {
		Component string  `json:"component"`
		Version   int     `json:"version"`
		Name      string  `json:"name"`
		Status    string  `json:"status"`
		AppliedAt *string `json:"applied_at"`
	} `json:"versions"`
	Applied, Pending, Unknown int
	Checks                    []struct {
		Target  string `json:"target"`
		OK      bool   `json:"ok"`
		Problem string `json:"problem"`
	} `json:"checks"`
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	tables := func() int {
		return db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name <> 'idem_schema_migration'", db.Schema)
	}

	// A fresh schema: everything pending, the table check names the fix.
	r := ok(t, db, "migrate", "status", "--topics", "orders")
	requireRow(t, r.Stdout, "processed_event:processed_event 1 processed_event pending")
	require.Contains(t, r.Stdout, "outbox:outbox_orders")
	requireRow(t, r.Stdout, "retry_parked_key:retry_parked_key 1 parked_key pending")
	requireRow(t, r.Stdout, "idem_audit 1 audit pending")
	requireRow(t, r.Stdout, "idem_heartbeat 1 heartbeat pending")
	require.Contains(t, r.Stdout, "0 applied, 15 pending, 0 unknown")
	require.Contains(t, r.Stdout, "does not exist; fix: migrate deduplicator.MigrationLine")
	st := decode[statusJSON](t, ok(t, db, "migrate", "status", "--topics", "orders", "--json"))
	require.Equal(t, 15, st.Pending)
	require.Zero(t, st.Applied)
	require.Nil(t, st.Versions[0].AppliedAt)
	require.False(t, st.Checks[0].OK)

	// --dry-run lists and changes nothing.
	r = ok(t, db, "migrate", "up", "--topics", "orders", "--dry-run")
	requireRow(t, r.Stdout, "would apply processed_event:processed_event 001_processed_event")
	requireRow(t, r.Stdout, "would apply outbox:outbox_orders 001_topic_tables")
	require.Zero(t, tables())

	r = ok(t, db, "migrate", "up", "--topics", "orders", "--retention", "30d")
	requireRow(t, r.Stdout, "applied processed_event:processed_event 002_retention_and_groups")
	requireRow(t, r.Stdout, "applied outbox:outbox_orders")
	require.Equal(t, "nothing to apply\n", ok(t, db, "migrate", "up").Stdout, "the outbox topic is found in idem_schema_migration")

	requireRow(t, r.Stdout, "applied retry_parked_key:retry_parked_key 001_parked_key")
	requireRow(t, r.Stdout, "applied idem_audit 001_audit")
	requireRow(t, r.Stdout, "applied idem_heartbeat 002_outbox_backlog")
	st = decode[statusJSON](t, ok(t, db, "migrate", "status", "--json"))
	require.Equal(t, 15, st.Applied)
	require.Zero(t, st.Pending)
	require.NotNil(t, st.Versions[0].AppliedAt)
	require.Len(t, st.Checks, 2)
	for _, c := range st.Checks {
		require.True(t, c.OK, c.Problem)
	}
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 30d")
	r = ok(t, db, "migrate", "status")
	require.Contains(t, r.Stdout, "check "+db.Schema+".processed_event (plain): ok")
	require.Contains(t, r.Stdout, "check outbox topic orders: ok")

	// A table migrated to the partitioned layout: auto-detected.
	ok(t, db, "migrate", "up", "--only", "dedup", "--layout", "partitioned")
	st = decode[statusJSON](t, ok(t, db, "migrate", "status", "--json"))
	require.Equal(t, 16, st.Applied)
	require.Equal(t, "partition_by_event_id", st.Versions[5].Name)
	// Under the plain layout, version 100 is recorded but unknown.
	st = decode[statusJSON](t, ok(t, db, "migrate", "status", "--only", "dedup", "--layout", "plain", "--json"))
	require.Equal(t, 1, st.Unknown)
	require.Equal(t, "unknown", st.Versions[5].Status)

	// sql: the pending ones, and every one without connecting.
	require.Equal(t, "-- nothing pending\n", ok(t, db, "migrate", "sql", "--pending").Stdout)
	r = run(t, nil, "migrate", "sql", "--schema", "billing", "--topics", "orders")
	require.Equal(t, 0, r.Code, r)
	require.Contains(t, r.Stdout, "-- processed_event:processed_event 001_processed_event.up.sql\n")
	require.Contains(t, r.Stdout, `CREATE TABLE IF NOT EXISTS "billing"."processed_event"`)
	require.Contains(t, r.Stdout, "-- outbox:outbox_orders 001_topic_tables.up.sql\n")
	require.NotContains(t, r.Stdout, "partition_by_event_id")
	r = run(t, nil, "migrate", "sql", "--only", "dedup", "--layout", "partitioned", "--down", "--json")
	require.Equal(t, 0, r.Code, r)
	migs := decode[[]struct {
		Version int    `json:"version"`
		Down    string `json:"down"`
	}](t, r)
	require.Equal(t, []int{100, 5, 4, 3, 2, 1}, []int{migs[0].Version, migs[1].Version, migs[2].Version, migs[3].Version, migs[4].Version, migs[5].Version})
	require.Contains(t, migs[5].Down, "DROP TABLE")

	// down: refused without --yes (nothing changes), listed by --dry-run.
	before := tables()
	fails(t, db, 2, "pass --yes", "migrate", "down")
	require.Equal(t, before, tables())
	st = decode[statusJSON](t, ok(t, db, "migrate", "status", "--json"))
	require.Equal(t, 16, st.Applied)
	r = ok(t, db, "migrate", "down", "--dry-run")
	requireRow(t, r.Stdout, "would revert outbox:outbox_orders 005_created_at_utc")
	requireRow(t, r.Stdout, "would revert retry_parked_key:retry_parked_key 002_parked_message")
	requireRow(t, r.Stdout, "would revert processed_event:processed_event 100_partition_by_event_id")
	requireRow(t, r.Stdout, "would revert idem_audit 001_audit")
	fails(t, db, 2, "--target needs --only", "migrate", "down", "--target", "1", "--yes")
	r = ok(t, db, "migrate", "down", "--only", "dedup", "--target", "2", "--yes", "--json")
	require.Contains(t, r.Stdout, `"version": 100`)
	r = ok(t, db, "migrate", "down", "--all", "--yes")
	requireRow(t, r.Stdout, "reverted outbox:outbox_orders")
	requireRow(t, r.Stdout, "reverted processed_event:processed_event 001_processed_event")
	require.Zero(t, tables())
	require.Equal(t, "nothing to revert\n", ok(t, db, "migrate", "down", "--all", "--yes").Stdout)

	fails(t, db, 2, `--only "x"`, "migrate", "up", "--only", "x")
	fails(t, db, 2, "no outbox topic", "migrate", "up", "--only", "outbox")
	fails(t, db, 2, "--retention", "migrate", "up", "--retention", "soon")
	fails(t, db, 2, "--layout", "migrate", "up", "--layout", "sideways")
	require.Zero(t, tables(), "bad input changes nothing")
}

// requireRow finds want in a table's output, runs of spaces counting as one.
func requireRow(t *testing.T, out, want string) {
	t.Helper()
	squeeze := regexp.MustCompile(` {2,}`)
	require.Contains(t, squeeze.ReplaceAllString(out, " "), want)
}
