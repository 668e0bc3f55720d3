package deduplicator

import (
	"context"
	"crypto/rand"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// v7At returns a UUIDv7 created at t with random bits.
func v7At(t time.Time) uuid.UUID {
	u := partition.Floor(t)
	var r [10]byte
	_, _ = rand.Read(r[:])
	u[6] = 0x70 | r[0]&0x0f
	u[7] = r[1]
	u[8] = 0x80 | r[2]&0x3f
	copy(u[9:], r[3:])
	return u
}

// v7AtMax returns the largest UUIDv7 created at t (every random bit set).
func v7AtMax(t time.Time) uuid.UUID {
	u := partition.Floor(t)
	u[6] = 0x7f
	u[7] = 0xff
	u[8] = 0xbf
	for i := 9; i < 16; i++ {
		u[i] = 0xff
	}
	return u
}

// retentionDB returns a test schema with the table migrated in layout.
func retentionDB(t *testing.T, layout Layout) (*pgtest.DB, TableConfig) {
	t.Helper()
	db := pgtest.New(t, 12)
	tc := TableConfig{Schema: db.Schema, Layout: layout}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, MigrationLine(tc)))
	tc.setDefaults()
	return db, tc
}

// insertRows inserts (id, group) rows with processed_at.
func insertRows(t *testing.T, pool *pgxpool.Pool, tc TableConfig, group string, processedAt time.Time, ids ...uuid.UUID) {
	t.Helper()
	_, err := pool.Exec(context.Background(),
		`INSERT INTO `+tc.Schema+`.`+tc.Table+` (event_id, consumer_group, processed_at) SELECT id, $2, $3 FROM unnest($1::uuid[]) id`,
		ids, group, processedAt)
	require.NoError(t, err)
}

// partitionOf returns the partition (relation name) holding the row.
func partitionOf(t *testing.T, db *pgtest.DB, tc TableConfig, id uuid.UUID) string {
	t.Helper()
	var name string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT tableoid::regclass::text FROM `+tc.Table+` WHERE event_id = $1`, id).Scan(&name))
	return name
}

func partitionNames(t *testing.T, db *pgtest.DB, tc TableConfig) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) ORDER BY 1`, tc.Schema+"."+tc.Table)
	require.NoError(t, err)
	var names []string
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		names = append(names, n)
	}
	require.NoError(t, rows.Err())
	return names
}

// logCapture is a LoggerAdapter that records messages.
type logCapture struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logCapture) add(msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msg)
}

func (l *logCapture) has(msg string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.msgs {
		if m == msg {
			return true
		}
	}
	return false
}

func (l *logCapture) Error(msg string, _ error, _ watermill.LogFields) { l.add(msg) }
func (l *logCapture) Info(msg string, _ watermill.LogFields)           { l.add(msg) }
func (l *logCapture) Debug(msg string, _ watermill.LogFields)          { l.add(msg) }
func (l *logCapture) Trace(msg string, _ watermill.LogFields)          { l.add(msg) }
func (l *logCapture) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// runOnceOutcome is what a RunOnce started by runOnceAsync returned.
type runOnceOutcome struct {
	res Result
	err error
}

// runOnceAsync starts c.RunOnce in the background and returns its outcome channel.
func runOnceAsync(ctx context.Context, c *Cleaner) <-chan runOnceOutcome {
	done := make(chan runOnceOutcome, 1)
	go func() {
		r, err := c.RunOnce(ctx)
		done <- runOnceOutcome{r, err}
	}()
	return done
}

// renderMigrations is the SQL a migrate.Migrator renders for cfg's line.
func renderMigrations(cfg TableConfig) ([]migrate.Migration, error) {
	m, err := migrate.New(nil, MigrationLine(cfg))
	if err != nil {
		return nil, err
	}
	return m.Migrations()
}
