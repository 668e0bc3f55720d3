package main_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/partition"
)

type checkJSON struct {
	EventID            string  `json:"event_id"`
	CreatedAt          *string `json:"created_at"`
	OlderThanRetention bool    `json:"older_than_retention"`
	Processed          bool    `json:"processed"`
	Groups             []struct {
		Group       string     `json:"group"`
		Processed   bool       `json:"processed"`
		ProcessedAt *time.Time `json:"processed_at"`
	} `json:"groups"`
}

// partitionsAhead is deduplicator.CleanerConfig.PartitionsAhead's default:
// the days of partitions after today's that a migration creates.
const partitionsAhead = 3

func TestDedupCheck(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	id, other, old := v7At(time.Now()), v7At(time.Now()), v7At(time.Now().AddDate(0, 0, -30))
	claim(t, db, "billing", true, id)
	claim(t, db, "shipping", true)

	r := ok(t, db, "dedup", "check", id.String(), "--group", "billing")
	require.Contains(t, r.Stdout, "event "+id.String()+", created ")
	require.Regexp(t, `billing\s+yes\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ`, r.Stdout)
	ok(t, db, "dedup", "check", id.String(), "--group", "billing", "--layout", "plain")
	c := decode[checkJSON](t, ok(t, db, "dedup", "check", "--json", "--group", "billing", id.String()))
	require.True(t, c.Processed)
	require.Equal(t, id.String(), c.EventID)
	require.NotNil(t, c.CreatedAt)
	require.Len(t, c.Groups, 1)
	require.NotNil(t, c.Groups[0].ProcessedAt)
	require.WithinDuration(t, time.Now(), *c.Groups[0].ProcessedAt, time.Hour)

	// Not processed: exit 3, also when one of the groups has not.
	r = ctl(t, db, "dedup", "check", other.String(), "--group", "billing")
	require.Equal(t, 3, r.Code, r)
	require.Regexp(t, `billing\s+no\s+-`, r.Stdout)
	require.Empty(t, r.Stderr)
	r = ctl(t, db, "dedup", "check", id.String(), "--json") // every registered group
	require.Equal(t, 3, r.Code, r)
	c = decode[checkJSON](t, r)
	require.False(t, c.Processed)
	require.Equal(t, "billing", c.Groups[0].Group)
	require.True(t, c.Groups[0].Processed)
	require.Equal(t, "shipping", c.Groups[1].Group)
	require.False(t, c.Groups[1].Processed)
	require.Nil(t, c.Groups[1].ProcessedAt)

	// Older than the retention and not processed: say why it matters.
	r = ctl(t, db, "dedup", "check", old.String(), "--group", "billing,shipping")
	require.Equal(t, 3, r.Code, r)
	require.Contains(t, r.Stdout, "older than the retention (7d)")

	// Bad input: exit 2 with the reason.
	fails(t, db, 2, `invalid event id "not-a-uuid"`, "dedup", "check", "not-a-uuid", "--group", "billing")
	fails(t, db, 2, `unknown consumer group "nosuch"`, "dedup", "check", id.String(), "--group", "nosuch")
	fails(t, db, 2, "missing EVENT_ID", "dedup", "check", "--group", "billing")
	fails(t, db, 2, "unexpected argument", "dedup", "check", id.String(), other.String())
	fails(t, db, 1, "does not exist (run idemctl migrate up", "dedup", "check", id.String(), "--table", "nope")
}

type statsJSON struct {
	Layout           string  `json:"layout"`
	Rows             int64   `json:"rows"`
	RetentionSeconds float64 `json:"retention_seconds"`
	Bytes            int64   `json:"bytes"`
	Oldest           *string `json:"oldest"`
	Groups           []struct {
		Group      string `json:"group"`
		Registered bool   `json:"registered"`
		Rows       int64  `json:"rows"`
	} `json:"groups"`
	Partitions []struct {
		Name    string  `json:"name"`
		Default bool    `json:"default"`
		From    *string `json:"from"`
		Rows    int64   `json:"rows"`
	} `json:"partitions"`
}

func TestDedupStats(t *testing.T) {
	t.Parallel()
	db := migrated(t, "partitioned")
	now := time.Now()
	claim(t, db, "billing", true, v7At(now), v7At(now), v7At(now.AddDate(0, 0, 1)))
	claim(t, db, "legacy", false, v7At(now.AddDate(0, 0, 40))) // far future: DEFAULT
	claim(t, db, "idle", true)                                 // registered, no claim

	r := ok(t, db, "dedup", "stats")
	require.Contains(t, r.Stdout, "table "+db.Schema+".processed_event (partitioned): 4 rows")
	require.Contains(t, r.Stdout, "retention 7d")
	require.Regexp(t, `billing\s+yes\s+3\s`, r.Stdout)
	require.Regexp(t, `legacy\s+no\s+1\s`, r.Stdout)
	require.Regexp(t, `idle\s+yes\s+0\s`, r.Stdout)
	today := partition.Name("processed_event", now)
	require.Regexp(t, today+`\s+\d{4}-\d\d-\d\d 00:00:00Z\s+\d{4}-\d\d-\d\d 00:00:00Z\s+2\s`, r.Stdout)
	require.Regexp(t, `processed_event_default\s+\(default\)\s+-\s+1\s`, r.Stdout)

	st := decode[statsJSON](t, ok(t, db, "dedup", "stats", "--json"))
	require.Equal(t, "partitioned", st.Layout)
	require.EqualValues(t, 4, st.Rows)
	require.EqualValues(t, 7*24*3600, st.RetentionSeconds)
	require.Positive(t, st.Bytes)
	require.NotNil(t, st.Oldest)
	require.Len(t, st.Groups, 3)
	require.Equal(t, "billing", st.Groups[0].Group)
	require.True(t, st.Groups[0].Registered)
	require.EqualValues(t, 3, st.Groups[0].Rows)
	require.Equal(t, "idle", st.Groups[1].Group)
	require.True(t, st.Groups[1].Registered)
	require.Zero(t, st.Groups[1].Rows)
	require.Equal(t, "legacy", st.Groups[2].Group)
	require.False(t, st.Groups[2].Registered)
	require.Len(t, st.Partitions, partitionsAhead+2)
	require.Equal(t, today, st.Partitions[0].Name)
	require.EqualValues(t, 2, st.Partitions[0].Rows)
	require.EqualValues(t, 1, st.Partitions[1].Rows)
	require.EqualValues(t, 1, st.Partitions[len(st.Partitions)-1].Rows)
	require.True(t, st.Partitions[len(st.Partitions)-1].Default)
	require.Nil(t, st.Partitions[len(st.Partitions)-1].From)

	// A plain, empty table.
	plain := migrated(t, "plain")
	st = decode[statsJSON](t, ok(t, plain, "dedup", "stats", "--json"))
	require.Equal(t, "plain", st.Layout)
	require.Zero(t, st.Rows)
	require.Nil(t, st.Oldest)
	require.Empty(t, st.Groups)
	require.Empty(t, st.Partitions)
	require.Contains(t, ok(t, plain, "dedup", "stats").Stdout, "(none)")
}

type cleanJSON struct {
	DryRun            bool     `json:"dry_run"`
	Skipped           bool     `json:"skipped"`
	Deleted           int64    `json:"deleted"`
	RowsMoved         int64    `json:"rows_moved"`
	PartitionsCreated []string `json:"partitions_created"`
	PartitionsDropped []string `json:"partitions_dropped"`
}

func TestCleanupRun(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	now := time.Now()
	var old []uuid.UUID
	for i := 0; i < 25; i++ {
		old = append(old, v7At(now.AddDate(0, 0, -8).Add(time.Duration(i)*time.Minute)))
	}
	claim(t, db, "unregistered", false, old...)
	claim(t, db, "unregistered", false, v7At(now), v7At(now))
	count := func() int { return db.Count(t, "SELECT 1 FROM processed_event") }

	r := ok(t, db, "cleanup", "run", "--dry-run", "--batch-size", "10")
	require.Contains(t, r.Stdout, "dry run on "+db.Schema+".processed_event (plain): nothing was changed")
	require.Regexp(t, `rows would be deleted\s+25 \(batches: 3`, r.Stdout)
	require.Equal(t, 27, count())
	c := decode[cleanJSON](t, ok(t, db, "cleanup", "run", "--dry-run", "--json"))
	require.True(t, c.DryRun)
	require.EqualValues(t, 25, c.Deleted)
	require.Equal(t, 27, count(), "a dry run deletes nothing")
	var cleaned *time.Time
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT cleaned_before FROM processed_event_setting").Scan(&cleaned))
	require.Nil(t, cleaned, "a dry run records nothing")

	c = decode[cleanJSON](t, ok(t, db, "cleanup", "run", "--json"))
	require.False(t, c.DryRun)
	require.EqualValues(t, 25, c.Deleted)
	require.Equal(t, 2, count())
	r = ok(t, db, "cleanup", "run")
	require.Contains(t, r.Stdout, "cleaned "+db.Schema+".processed_event (plain)")
	require.Regexp(t, `rows deleted\s+0 \(batches: 1`, r.Stdout)

	fails(t, db, 2, "must not be negative", "cleanup", "run", "--batch-size", "-1")
	fails(t, db, 2, "flag provided but not defined: -nope", "cleanup", "run", "--nope")
	fails(t, db, 2, "DeleteNonV7", "cleanup", "run", "--delete-non-v7", "--layout", "partitioned")
}

func TestPartitions(t *testing.T) {
	t.Parallel()
	db := migrated(t, "partitioned")
	now := time.Now()
	claim(t, db, "g", false, v7At(now.AddDate(0, 0, 5))) // DEFAULT, moved by --ahead 6

	r := ok(t, db, "partitions", "list")
	require.Contains(t, r.Stdout, partition.Name("processed_event", now))
	require.Regexp(t, `processed_event_default\s+\(default\)`, r.Stdout)
	type part struct {
		Name    string `json:"name"`
		Default bool   `json:"default"`
	}
	before := decode[[]part](t, ok(t, db, "partitions", "list", "--json"))
	require.Len(t, before, partitionsAhead+2)

	c := decode[cleanJSON](t, ok(t, db, "partitions", "maintain", "--ahead", "6", "--dry-run", "--json"))
	require.True(t, c.DryRun)
	want := []string{}
	for i := partitionsAhead + 1; i <= 6; i++ {
		want = append(want, partition.Name("processed_event", now.AddDate(0, 0, i)))
	}
	require.ElementsMatch(t, want, c.PartitionsCreated)
	require.EqualValues(t, 1, c.RowsMoved)
	require.Equal(t, before, decode[[]part](t, ok(t, db, "partitions", "list", "--json")), "a dry run creates nothing")

	r = ok(t, db, "partitions", "maintain", "--ahead", "6")
	require.Regexp(t, `partitions created\s+3: processed_event_p`, r.Stdout)
	require.Regexp(t, `rows moved from DEFAULT\s+1\n`, r.Stdout)
	require.Len(t, decode[[]part](t, ok(t, db, "partitions", "list", "--json")), len(before)+3)

	plain := migrated(t, "plain")
	require.Contains(t, ok(t, plain, "partitions", "list").Stdout, "has no partitions (layout plain)")
	require.Equal(t, "[]\n", ok(t, plain, "partitions", "list", "--json").Stdout)
	fails(t, plain, 2, "is not partitioned (layout plain)", "partitions", "maintain")
}
