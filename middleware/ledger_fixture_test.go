package middleware_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// ledgerFixture is a test schema with a migrated processed_event table, a
// business table ledger(event_id, consumer_group, amount) and a pool whose
// statements are recorded, so a test can tell COMMIT from ROLLBACK.
type ledgerFixture struct {
	db   *pgtest.DB
	pool *pgxpool.Pool
	sql  *sqlRecorder
}

func newLedgerFixture(t *testing.T) *ledgerFixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	db.Exec(t, `CREATE TABLE ledger (
		event_id uuid NOT NULL,
		consumer_group text NOT NULL,
		amount bigint NOT NULL
	)`)

	rec := &sqlRecorder{}
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 8
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return &ledgerFixture{db: db, pool: pool, sql: rec}
}

// dedup returns a middleware for group on the fixture's pool; mod may adjust
// the config.
func (f *ledgerFixture) dedup(t *testing.T, group string, mod func(*idem.Config)) *idem.Dedup {
	t.Helper()
	cfg := idem.Config{
		DB:            f.pool,
		ConsumerGroup: group,
		Table:         deduplicator.TableConfig{Schema: f.db.Schema},
	}
	if mod != nil {
		mod(&cfg)
	}
	d, err := idem.NewDedup(cfg, nil)
	require.NoError(t, err)
	return d
}

// msg returns a message carrying id in the event_id metadata.
func (f *ledgerFixture) msg(id uuid.UUID) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(`{"amount":1}`))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	return m
}

// insertHandler writes one ledger row with amount in the middleware's
// transaction and counts its calls.
func (f *ledgerFixture) insertHandler(amount int64, calls *atomic.Int32) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		ctx := m.Context()
		tx := idem.MustTxFromContext(ctx)
		id, _ := idem.EventIDFromContext(ctx)
		group, _ := idem.ConsumerGroupFromContext(ctx)
		_, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, $2, $3)", id, group, amount)
		return nil, err
	}
}

// failingHandler writes its ledger row like insertHandler, then fails with
// err: the write must not survive.
func (f *ledgerFixture) failingHandler(amount int64, calls *atomic.Int32, err error) message.HandlerFunc {
	insert := f.insertHandler(amount, calls)
	return func(m *message.Message) ([]*message.Message, error) {
		if _, ierr := insert(m); ierr != nil {
			return nil, ierr
		}
		return nil, err
	}
}

func (f *ledgerFixture) ledgerRows(t *testing.T) int {
	t.Helper()
	return f.db.Count(t, "SELECT 1 FROM ledger")
}

func (f *ledgerFixture) claims(t *testing.T) int {
	t.Helper()
	return f.db.Count(t, "SELECT 1 FROM processed_event")
}

// ledgerBackendPID returns the server pid of the connection running tx, or
// -1 on error (it runs in handler goroutines, where t.FailNow is not allowed).
func ledgerBackendPID(ctx context.Context, tx pgx.Tx) int32 {
	var pid int32
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return -1
	}
	return pid
}

// blockedBy reports how many server backends wait on a lock held by pid.
func (f *ledgerFixture) blockedBy(t *testing.T, pid int32) int {
	t.Helper()
	return f.db.Count(t, "SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid)) AND wait_event_type = 'Lock'", pid)
}

// sqlRecorder is a pgx tracer that records the statements the pool runs.
type sqlRecorder struct {
	mu   sync.Mutex
	stmt []string
}

func (r *sqlRecorder) add(sql string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stmt = append(r.stmt, strings.ToLower(strings.TrimSpace(sql)))
}

// reset forgets what was recorded so far.
func (r *sqlRecorder) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stmt = nil
}

// total returns how many statements were recorded.
func (r *sqlRecorder) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.stmt)
}

// count returns how many recorded statements are exactly sql (lower case).
func (r *sqlRecorder) count(sql string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, s := range r.stmt {
		if s == sql {
			n++
		}
	}
	return n
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	r.add(data.SQL)
	return ctx
}

func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *sqlRecorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *sqlRecorder) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	r.add(data.SQL)
}

func (r *sqlRecorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

var (
	_ pgx.QueryTracer = (*sqlRecorder)(nil)
	_ pgx.BatchTracer = (*sqlRecorder)(nil)
)

// ageGroup registers group with processed_event (in db's schema) as first
// seen long ago, as a group that has run for longer than the retention is:
// its claims may have been cleaned, so its stale guard refuses old events. A
// group first seen now lets them through (it cannot have lost a claim).
func ageGroup(t *testing.T, db *pgtest.DB, group string) {
	t.Helper()
	db.Exec(t, `INSERT INTO processed_event_group (consumer_group, first_seen_at, idempotency_namespace)
VALUES ($1, '-infinity', $1) ON CONFLICT (consumer_group) DO UPDATE SET first_seen_at = '-infinity'`, group)
}
