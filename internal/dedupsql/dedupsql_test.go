package dedupsql_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// migrated is a schema of its own with a plain processed_event table.
func migrated(t *testing.T) (*pgtest.DB, deduplicator.TableConfig) {
	t.Helper()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema} // Retention zero: the recorded value
	require.NoError(t, migrate.Up(context.Background(), db.Pool, deduplicator.MigrationLine(table)))
	return db, table
}

// The retention is recorded with the table: Migrate records it for a new
// table, the middleware and the Cleaner read it, and a configured value that
// differs is refused. SetRetention changes it for every component: running
// consumers re-read it within RefreshInterval, so the Cleaner applies a
// shortening only twice that long later.
func TestSetRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, table := migrated(t)
	recorded := func() time.Duration {
		s, err := dedupsql.ReadSetting(ctx, db.Pool, table.Schema, table.Table)
		require.NoError(t, err)
		return s.Retention
	}
	require.Equal(t, deduplicator.DefaultRetention, recorded())
	require.Equal(t, deduplicator.RetentionRefreshInterval, dedupsql.RefreshInterval)

	// A component configured with another value is refused, not obeyed.
	other := table
	other.Retention = 24 * time.Hour
	require.ErrorIs(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(other)), deduplicator.ErrRetentionMismatch)

	// Lengthen it for DLQ replays: every component reads the new value.
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, table.Schema, "", 30*24*time.Hour))
	require.Equal(t, 30*24*time.Hour, recorded())
	require.ErrorContains(t, dedupsql.SetRetention(ctx, db.Pool, table.Schema, "", 0), "must be positive")

	// Shorten it again: the Cleaner keeps the longer value until every
	// running consumer has re-read the shorter one.
	require.NoError(t, dedupsql.SetRetention(ctx, db.Pool, table.Schema, "", 7*24*time.Hour))
	cleanerAt := func(now time.Time) time.Duration {
		c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: db.Pool, NowFunc: func() time.Time { return now }}, nil)
		require.NoError(t, err)
		res, err := c.RunOnce(ctx)
		require.NoError(t, err)
		return res.Retention
	}
	require.Equal(t, 30*24*time.Hour, cleanerAt(time.Now()))
	require.Equal(t, 7*24*time.Hour, cleanerAt(time.Now().Add(2*dedupsql.RefreshInterval+time.Second)))
}

// RenameGroup gives a consumer group's claims and registration to a new
// name in one transaction: events applied under the old name stay
// duplicates, and the new name keeps the old one's first-seen time and
// Idempotency-Key namespace, so downstream keys do not change. Stop the
// consumers first, move the Kafka offsets, start them under the new name,
// then ForgetGroup removes the old one.
func TestRenameAndForgetGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, table := migrated(t)
	pool := db.Pool
	newDedup := func(group string) *deduplicator.Deduplicator {
		d, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: group}, nil)
		require.NoError(t, err)
		_, err = d.Register(ctx, pool, "") // what the middleware does at start-up
		require.NoError(t, err)
		return d
	}
	claim := func(d *deduplicator.Deduplicator, id uuid.UUID) (first bool) {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			first, err = d.Claim(ctx, tx, id)
			return err
		}))
		return first
	}
	check := deduplicator.ValidateGroupName

	v1 := newDedup("billing-v1")
	applied := uuid.Must(uuid.NewV7())
	claim(v1, applied)
	claim(v1, uuid.Must(uuid.NewV7()))

	renamed, copied, err := dedupsql.RenameGroup(ctx, pool, table.Schema, "", "billing-v1", "billing-v2", check)
	require.NoError(t, err)
	require.EqualValues(t, 2, copied)
	require.Equal(t, "billing-v1", renamed.IdempotencyNamespace)

	v2 := newDedup("billing-v2")
	require.False(t, claim(v2, applied), "applied under v1: a duplicate for v2")

	groups, err := dedupsql.Groups(ctx, pool, table.Schema, "")
	require.NoError(t, err)
	require.Len(t, groups, 2)
	for i, name := range []string{"billing-v1", "billing-v2"} {
		require.Equal(t, name, groups[i].Name)
		require.Equal(t, "billing-v1", groups[i].IdempotencyNamespace)
		// First seen less than a retention ago: the Cleaner keeps every claim.
		require.True(t, groups[i].Young(time.Now(), deduplicator.DefaultRetention))
	}

	_, _, err = dedupsql.RenameGroup(ctx, pool, table.Schema, "", "billing-v1", "billing-v2", check)
	require.ErrorIs(t, err, dedupsql.ErrGroupExists)
	_, _, err = dedupsql.RenameGroup(ctx, pool, table.Schema, "", "nobody", "billing-v3", check)
	require.ErrorIs(t, err, dedupsql.ErrGroupNotFound)
	_, _, err = dedupsql.RenameGroup(ctx, pool, table.Schema, "", "billing-v1", "billing-v1", check)
	require.ErrorContains(t, err, "two different, non-empty names")

	// Nothing consumes as billing-v1 any more: remove its claims and registration.
	forgotten, err := dedupsql.ForgetGroup(ctx, pool, table.Schema, "", "billing-v1", check)
	require.NoError(t, err)
	require.EqualValues(t, 2, forgotten)
	groups, err = dedupsql.Groups(ctx, pool, table.Schema, "")
	require.NoError(t, err)
	require.Len(t, groups, 1)
	require.Equal(t, "billing-v2", groups[0].Name)
	_, err = dedupsql.ForgetGroup(ctx, pool, table.Schema, "", "billing-v1", check)
	require.ErrorIs(t, err, dedupsql.ErrGroupNotFound)

	// The name check runs first: a refused name reaches no statement.
	refuse := func(field, name string) error { return errors.New(field + " refused") }
	_, err = dedupsql.ForgetGroup(ctx, pool, table.Schema, "", "billing-v2", refuse)
	require.ErrorContains(t, err, "group refused")
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event_group"))
}
