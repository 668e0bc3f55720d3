package main_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type convertJSON struct {
	Table       string `json:"table"`
	Layout      string `json:"layout"`
	DryRun      bool   `json:"dry_run"`
	Converted   bool   `json:"converted"`
	Was         string `json:"was"`
	Rows        int64  `json:"rows"`
	Kept        int64  `json:"kept"`
	Merged      int64  `json:"merged"`
	GroupFilled int64  `json:"group_filled"`
}

// dedup convert on the seed's table (NULL consumer_group): without --group
// it refuses and names the flag; --dry-run reports the rows kept and merged
// and changes nothing; the conversion gives the NULL rows the group, and the
// table then passes Check and answers dedup check.
func TestDedupConvert_SeedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	db.Exec(t, `CREATE TABLE processed_event (event_id uuid PRIMARY KEY, consumer_group text, processed_at timestamptz DEFAULT now())`)
	x, y, z := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()
	db.Exec(t, "INSERT INTO processed_event (event_id) VALUES ($1), ($2)", x, y)
	db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'notifications')", z)
	tc := deduplicator.TableConfig{Schema: db.Schema}

	fails(t, db, 2, "pass --group", "dedup", "convert")
	fails(t, db, 2, "--group", "dedup", "convert", "--group", "")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group IS NULL"), "nothing changed")

	c := decode[convertJSON](t, ok(t, db, "dedup", "convert", "--group", "billing", "--dry-run", "--json"))
	require.Equal(t, convertJSON{Table: db.Schema + ".processed_event", Layout: "plain", DryRun: true, Converted: true, Was: c.Was,
		Rows: 3, Kept: 3, Merged: 0, GroupFilled: 2}, c)
	require.Contains(t, c.Was, "consumer_group is nullable")
	r := ok(t, db, "dedup", "convert", "--group", "billing", "--dry-run")
	require.Contains(t, r.Stdout, "dry run on "+db.Schema+".processed_event (to plain): nothing was changed")
	require.Regexp(t, `rows would be kept\s+3`, r.Stdout)
	require.Regexp(t, `rows would be merged\s+0`, r.Stdout)
	require.Regexp(t, `rows would be given group billing\s+2`, r.Stdout)
	require.Error(t, deduplicator.Check(ctx, db.Pool, tc), "the dry run changed nothing")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group IS NULL"))

	r = ok(t, db, "dedup", "convert", "--group", "billing")
	require.Contains(t, r.Stdout, "converted "+db.Schema+".processed_event (plain)")
	require.Regexp(t, `rows kept\s+3`, r.Stdout)
	require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
	ok(t, db, "dedup", "check", x.String(), "--group", "billing")
	ok(t, db, "dedup", "check", z.String(), "--group", "notifications")

	r = ok(t, db, "dedup", "convert")
	require.Contains(t, r.Stdout, "already has the expected columns and key: nothing converted")
	fails(t, db, 2, "drop --group", "dedup", "convert", "--group", "billing")
}

// A table keyed by (event_id, processed_at) holds an event twice for one
// group: the dry run counts the merged row, the conversion keeps one.
func TestDedupConvert_ReportsMergedRows(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 4)
	db.Exec(t, `CREATE TABLE processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, processed_at))`)
	x := publisher.NewEventID()
	db.Exec(t, "INSERT INTO processed_event VALUES ($1, 'billing', now() - interval '1 hour'), ($1, 'billing', now())", x)

	c := decode[convertJSON](t, ok(t, db, "dedup", "convert", "--dry-run", "--json"))
	require.Equal(t, int64(2), c.Rows)
	require.Equal(t, int64(1), c.Kept)
	require.Equal(t, int64(1), c.Merged)
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event"))
	c = decode[convertJSON](t, ok(t, db, "dedup", "convert", "--json"))
	require.False(t, c.DryRun)
	require.Equal(t, int64(1), c.Merged)
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event"))
}
