package deduplicator_test

import (
	"bytes"
	"cmp"
	"context"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// pair is one processed_event row's key and time.
type pair struct {
	EventID     uuid.UUID
	Group       string
	ProcessedAt time.Time
}

func insertPairs(t *testing.T, db *pgtest.DB, rows ...pair) {
	t.Helper()
	for _, r := range rows {
		db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group, processed_at) VALUES ($1, $2, $3)", r.EventID, r.Group, r.ProcessedAt)
	}
}

// pairs returns the table's rows ordered by key.
func pairs(t *testing.T, db *pgtest.DB, table string) []pair {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), "SELECT event_id, consumer_group, processed_at FROM "+table+" ORDER BY 1, 2, 3")
	require.NoError(t, err)
	defer rows.Close()
	var out []pair
	for rows.Next() {
		var p pair
		require.NoError(t, rows.Scan(&p.EventID, &p.Group, &p.ProcessedAt))
		p.ProcessedAt = p.ProcessedAt.UTC()
		out = append(out, p)
	}
	require.NoError(t, rows.Err())
	return out
}

// sortPairs orders rows as pairs returns them: by event id, then group.
func sortPairs(ps []pair) []pair {
	out := slices.Clone(ps)
	slices.SortFunc(out, func(a, b pair) int {
		return cmp.Or(bytes.Compare(a.EventID[:], b.EventID[:]), strings.Compare(a.Group, b.Group))
	})
	return out
}

var (
	june = time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	july = time.Date(2026, 7, 2, 8, 30, 0, 0, time.UTC)
	// later: keys (event_id, processed_at) of the partitioned reference
	// table must differ even across groups.
	later = july.Add(time.Hour)
)

// The reference DDL's PRIMARY KEY (event_id): a second consumer group skips
// an event it never processed. After ConvertTable every row is kept, Check
// passes, Migrate proceeds, and each group claims the event once.
func TestConvertTable_ReferencePrimaryKey(t *testing.T) {
	t.Parallel()
	for _, layout := range []deduplicator.Layout{deduplicator.LayoutPlain, deduplicator.LayoutPartitioned} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.New(t, 2)
			tc := deduplicator.TableConfig{Schema: db.Schema, Layout: layout}
			db.Exec(t, referenceDDL)
			x, y, z := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()
			rows := []pair{{x, "billing", june}, {y, "billing", july}, {z, "notifications", june}}
			insertPairs(t, db, rows...)

			// The bug (notifications would skip x, which only billing processed)
			// cannot be silent: the claim names its conflict target, the key.
			claimNoMatchingKey(t, db, tc, "notifications", x)
			requireTableError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)), deduplicator.ErrTableKey, db.Schema+".processed_event")

			res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
			require.NoError(t, err)
			require.True(t, res.Converted)
			require.Contains(t, res.Was, "primary key is (event_id)")
			require.EqualValues(t, 3, res.Rows)
			require.EqualValues(t, 3, res.Kept)
			require.Zero(t, res.Collapsed)
			require.Equal(t, sortPairs(rows), pairs(t, db, "processed_event"))

			require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
			require.Equal(t, layout == deduplicator.LayoutPartitioned, db.Count(t, "SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'processed_event'::regclass") == 1)
			require.Zero(t, db.Count(t, "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = 'ix_processed_event_processed_at'", db.Schema), "the old table's indexes went with it")
			// Migration 2 registered the groups found in the converted rows
			// as old ones (first seen unknown: their stale guard stays on).
			groups, err := dedupsql.Groups(ctx, db.Pool, tc.Schema, tc.Table)
			require.NoError(t, err)
			require.Len(t, groups, 2)
			for _, g := range groups {
				require.Contains(t, []string{"billing", "notifications"}, g.Name)
				require.True(t, g.FirstSeen.IsZero(), "%+v", g)
			}

			require.True(t, claimRolledBack(t, db, tc, "notifications", x), "after: notifications processes x")
			require.False(t, claimRolledBack(t, db, tc, "billing", x), "after: billing still skips x")
			require.False(t, claimRolledBack(t, db, tc, "notifications", z))

			// Converting again changes nothing.
			res, err = deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
			require.NoError(t, err)
			require.Equal(t, deduplicator.ConvertResult{}, res)
			require.Equal(t, sortPairs(rows), pairs(t, db, "processed_event"))
		})
	}
}

// The reference's TTL variant, PRIMARY KEY (event_id, processed_at) with
// partitions on processed_at: a redelivery is a new key and runs the
// handler twice, and such a table already holds duplicate pairs. The
// conversion keeps one row per pair (the earliest) and counts the others.
func TestConvertTable_PartitionedByProcessedAt(t *testing.T) {
	t.Parallel()
	for _, layout := range []deduplicator.Layout{deduplicator.LayoutPlain, deduplicator.LayoutPartitioned} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.New(t, 2)
			tc := deduplicator.TableConfig{Schema: db.Schema, Layout: layout}
			db.Exec(t, referencePartitionedDDL)
			x, y := publisher.NewEventID(), publisher.NewEventID()
			insertPairs(t, db,
				pair{x, "billing", july}, pair{x, "billing", june}, // applied twice: once in each partition
				pair{x, "notifications", later},
				pair{y, "billing", june},
			)

			// The bug (billing would run x a third time) cannot be silent.
			claimNoMatchingKey(t, db, tc, "billing", x)
			requireTableError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)), deduplicator.ErrTableKey, db.Schema+".processed_event")

			res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
			require.NoError(t, err)
			require.True(t, res.Converted)
			require.Contains(t, res.Was, "partitioned by RANGE (processed_at)")
			require.Equal(t, deduplicator.ConvertResult{Converted: true, Was: res.Was, Rows: 4, Kept: 3, Collapsed: 1}, res)
			require.Equal(t, sortPairs([]pair{{x, "billing", june}, {x, "notifications", later}, {y, "billing", june}}), pairs(t, db, "processed_event"), "every pair, with its earliest processed_at")

			require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
			require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name LIKE 'processed_event_2026%'", db.Schema), "the old partitions are gone")

			require.False(t, claimRolledBack(t, db, tc, "billing", x), "after: billing skips x")
			require.False(t, claimRolledBack(t, db, tc, "notifications", x))
			require.True(t, claimRolledBack(t, db, tc, "notifications", y))
		})
	}
}

// The rendered SQL applied by a migration tool to the reference's table
// leaves it as it is and records the versions (with LayoutPartitioned,
// version 100 too, although the table is not partitioned on event_id). The
// conversion forgets version 100, so Migrate partitions the converted table.
func TestConvertTable_AfterVersionsWereRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema, Layout: deduplicator.LayoutPartitioned}
	db.Exec(t, referencePartitionedDDL)
	migs := renderMigrations(t, tc)
	for _, m := range migs {
		db.Exec(t, m.Up) // no-ops on this table, recorded
	}
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE version = 100"), "the rendered SQL recorded the partitioned layout")
	x := publisher.NewEventID()
	insertPairs(t, db, pair{x, "billing", june}, pair{x, "billing", july})

	requireTableError(t, deduplicator.Check(ctx, db.Pool, tc), deduplicator.ErrTableKey, db.Schema+".processed_event")
	res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Collapsed)
	require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
	require.Equal(t, "RANGE (event_id)", scalar[string](t, db, "SELECT pg_get_partkeydef('processed_event'::regclass)"))
	require.Equal(t, []pair{{x, "billing", june}}, pairs(t, db, "processed_event"))
}

// A table without consumer_group (used by one group): its rows belong to
// the group the caller names, and the conversion refuses to guess.
func TestConvertTable_NoConsumerGroupColumn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	db.Exec(t, "CREATE TABLE processed_event (event_id uuid PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now())")
	x, y := publisher.NewEventID(), publisher.NewEventID()
	db.Exec(t, "INSERT INTO processed_event VALUES ($1, $2), ($3, $4)", x, june, y, july)

	requireTableError(t, deduplicator.Check(ctx, db.Pool, tc), deduplicator.ErrTableColumns, db.Schema+".processed_event")
	requireTableError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)), deduplicator.ErrTableColumns, db.Schema+".processed_event")
	_, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	terr := requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
	require.Contains(t, terr.Fix, "ConsumerGroup")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event"), "nothing changed")

	res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Equal(t, deduplicator.ConvertResult{Converted: true, Was: res.Was, Rows: 2, Kept: 2, GroupFilled: 2}, res)
	require.Equal(t, sortPairs([]pair{{x, "billing", june}, {y, "billing", july}}), pairs(t, db, "processed_event"))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
	require.True(t, claimRolledBack(t, db, tc, "notifications", x))
	require.False(t, claimRolledBack(t, db, tc, "billing", x))

	// A table with the column keeps its groups: naming one is refused.
	_, err = deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{ConsumerGroup: "billing"})
	requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
}

// The conversion never drops data it cannot carry, and does nothing when
// there is no table to adopt; a failed conversion leaves the table as it was.
func TestConvertTable_Refusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}

	_, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	requireTableError(t, err, deduplicator.ErrTableMissing, db.Schema+".processed_event")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "nothing created")

	db.Exec(t, referenceDDL+"; ALTER TABLE processed_event ADD COLUMN payload jsonb")
	insertPairs(t, db, pair{publisher.NewEventID(), "billing", june})
	_, err = deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	terr := requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
	require.Contains(t, terr.Problem, "payload would be lost")
	db.Exec(t, "ALTER TABLE processed_event DROP COLUMN payload")

	// A non-v7 id cannot be placed in a daily partition: the whole
	// conversion rolls back, the reference table and its rows stay.
	insertPairs(t, db, pair{uuid.New(), "billing", july})
	_, err = deduplicator.ConvertTable(ctx, db.Pool, deduplicator.TableConfig{Schema: db.Schema, Layout: deduplicator.LayoutPartitioned}, deduplicator.ConvertOptions{})
	require.ErrorContains(t, err, "not UUIDv7")
	requireTableError(t, deduplicator.Check(ctx, db.Pool, tc), deduplicator.ErrTableKey, db.Schema+".processed_event")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name <> 'processed_event'", db.Schema))

	// The plain layout takes any id.
	res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Kept)
}

// docsSQL returns the SQL block of docs/operations.md that follows marker.
func docsSQL(t *testing.T, marker string) string {
	t.Helper()
	doc, err := os.ReadFile("../docs/operations.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)" + regexp.QuoteMeta(marker) + ".*?```sql\n(.*?)```").FindSubmatch(doc)
	require.NotNil(t, m, "docs/operations.md has no sql block after %q", marker)
	return string(m[1])
}

// The psql version of the conversion printed in docs/operations.md works on
// both reference tables, and Migrate then proceeds.
func TestConvertSQLInDocs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	convert := docsSQL(t, "<!-- convert-sql -->")
	x, y := publisher.NewEventID(), publisher.NewEventID()
	for name, tc := range map[string]struct {
		ddl        string
		rows, want []pair
	}{
		"primary key event_id": {referenceDDL,
			[]pair{{x, "billing", june}, {y, "notifications", july}},
			[]pair{{x, "billing", june}, {y, "notifications", july}}},
		"partitioned by processed_at": {referencePartitionedDDL,
			[]pair{{x, "billing", july}, {x, "billing", june}, {x, "notifications", later}},
			[]pair{{x, "billing", june}, {x, "notifications", later}}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t, 2)
			table := deduplicator.TableConfig{Schema: db.Schema}
			db.Exec(t, tc.ddl)
			insertPairs(t, db, tc.rows...)
			db.Exec(t, convert)
			require.Equal(t, sortPairs(tc.want), pairs(t, db, "processed_event"))
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
			require.NoError(t, deduplicator.Check(ctx, db.Pool, table))
			require.True(t, claimRolledBack(t, db, table, "audit", x), "a new group processes x")
			require.False(t, claimRolledBack(t, db, table, "billing", x))
		})
	}
}

func scalar[T any](t *testing.T, db *pgtest.DB, query string, args ...any) T {
	t.Helper()
	var v T
	require.NoError(t, db.Pool.QueryRow(context.Background(), query, args...).Scan(&v))
	return v
}

// seedDDL is the table the seed's code made: consumer_group nullable, and
// the code inserted only event_id, so its rows have no group.
const seedDDL = `CREATE TABLE processed_event (event_id uuid PRIMARY KEY, consumer_group text, processed_at timestamptz DEFAULT now())`

// The seed's own table, as its code filled it (rows without a group, one
// with a group, one without a processed_at): Check names the nullable
// group and the key, with a fix that mends both; ConvertTable without a
// group is refused with the option to set, and with one gives the NULL
// rows that group and keeps the others'. A dry run reports the same and
// changes nothing.
func TestConvertTable_SeedTableWithNullGroups(t *testing.T) {
	t.Parallel()
	for _, layout := range []deduplicator.Layout{deduplicator.LayoutPlain, deduplicator.LayoutPartitioned} {
		t.Run(layout.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.New(t, 2)
			tc := deduplicator.TableConfig{Schema: db.Schema, Layout: layout}
			db.Exec(t, seedDDL)
			x, y, z, w := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()
			db.Exec(t, "INSERT INTO processed_event (event_id) VALUES ($1)", x)
			db.Exec(t, "INSERT INTO processed_event (event_id, processed_at) VALUES ($1, $2)", y, june)
			db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group, processed_at) VALUES ($1, 'notifications', $2)", z, july)
			db.Exec(t, "INSERT INTO processed_event (event_id, processed_at) VALUES ($1, NULL)", w)

			terr := requireTableError(t, deduplicator.Check(ctx, db.Pool, tc), deduplicator.ErrTableColumns, db.Schema+".processed_event")
			require.Contains(t, terr.Problem, "consumer_group is nullable")
			require.Contains(t, terr.Problem, "primary key is (event_id)", "the key is named too")
			require.Contains(t, terr.Fix, "ConvertOptions.ConsumerGroup")
			require.Contains(t, terr.Fix, "(event_id, consumer_group)", "the fix mends the key too")

			// Without a group: a typed error naming the option, nothing changed.
			_, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
			terr = requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
			require.Contains(t, terr.Problem, "3 rows have a NULL consumer_group")
			require.Contains(t, terr.Fix, "ConvertOptions.ConsumerGroup")
			require.Equal(t, 4, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group IS NULL OR consumer_group = 'notifications'"))

			// Dry run: the counts, nothing changed.
			res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{ConsumerGroup: "billing", DryRun: true})
			require.NoError(t, err)
			require.Equal(t, deduplicator.ConvertResult{Converted: true, DryRun: true, Was: res.Was, Rows: 4, Kept: 4, GroupFilled: 3}, res)
			require.Contains(t, res.Was, "consumer_group is nullable")
			require.Equal(t, 3, db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group IS NULL"), "the dry run changed nothing")
			requireTableError(t, deduplicator.Check(ctx, db.Pool, tc), deduplicator.ErrTableColumns, db.Schema+".processed_event")

			res, err = deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{ConsumerGroup: "billing"})
			require.NoError(t, err)
			require.Equal(t, deduplicator.ConvertResult{Converted: true, Was: res.Was, Rows: 4, Kept: 4, GroupFilled: 3}, res)
			got := pairs(t, db, "processed_event")
			require.Len(t, got, 4)
			for _, p := range got {
				switch p.EventID {
				case x, w:
					require.Equal(t, "billing", p.Group)
					require.WithinDuration(t, time.Now(), p.ProcessedAt, time.Hour, "the default, or the conversion's time for a NULL")
				case y:
					require.Equal(t, pair{y, "billing", june}, p)
				case z:
					require.Equal(t, pair{z, "notifications", july}, p)
				}
			}
			require.NoError(t, deduplicator.Check(ctx, db.Pool, tc))
			require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc)))
			require.False(t, claimRolledBack(t, db, tc, "billing", x), "billing processed x: a duplicate")
			require.True(t, claimRolledBack(t, db, tc, "notifications", x), "notifications never did")
			require.False(t, claimRolledBack(t, db, tc, "notifications", z))
		})
	}
}

// A NULL group that becomes the named group merges with that group's row of
// the same event: one row is kept (the earliest), the other counted.
func TestConvertTable_NullGroupMergesWithTheNamedGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tc := deduplicator.TableConfig{Schema: db.Schema}
	db.Exec(t, "CREATE TABLE processed_event (event_id uuid, consumer_group text, processed_at timestamptz)")
	x := publisher.NewEventID()
	db.Exec(t, "INSERT INTO processed_event VALUES ($1, NULL, $2), ($1, 'billing', $3)", x, july, june)

	res, err := deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Equal(t, deduplicator.ConvertResult{Converted: true, Was: res.Was, Rows: 2, Kept: 1, Collapsed: 1, GroupFilled: 1}, res)
	require.Equal(t, []pair{{x, "billing", june}}, pairs(t, db, "processed_event"))

	// A NULL event id names no event: refused, with the DELETE to run.
	db.Exec(t, "DROP TABLE processed_event; DELETE FROM "+"idem_schema_migration")
	db.Exec(t, "CREATE TABLE processed_event (event_id uuid, consumer_group text NOT NULL, processed_at timestamptz)")
	db.Exec(t, "INSERT INTO processed_event VALUES (NULL, 'billing', now())")
	_, err = deduplicator.ConvertTable(ctx, db.Pool, tc, deduplicator.ConvertOptions{})
	terr := requireTableError(t, err, deduplicator.ErrTableColumns, db.Schema+".processed_event")
	require.Contains(t, terr.Problem, "1 rows have a NULL event_id")
	require.Contains(t, terr.Fix, "DELETE FROM")
}
