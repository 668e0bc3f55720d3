// Package pgtest gives each test its own PostgreSQL schema on the real server
// (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/test), so packages
// and tests run in parallel without seeing each other's rows.
package pgtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
)

// DefaultURL is used when DATABASE_URL is not set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns DATABASE_URL or DefaultURL.
func URL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// DB is a test's schema and a pool whose search_path points at it.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
	// URL connects with search_path set to Schema.
	URL string
}

// DefaultMaxConns caps the pools New (maxConns 0) and ForExample open:
// pgxpool's own default grows with the machine's CPUs, and the suite's
// connection budget must not (README, "Testing").
const DefaultMaxConns = 4

// UnitEnv, when set in the environment (make test/unit), skips every test
// that needs PostgreSQL or a Kafka broker: the run is the tests that need
// neither, on a bare machine.
const UnitEnv = "IDEM_UNIT"

// SkipInUnitRun skips tb in a unit run (see [UnitEnv]); tests that reach
// PostgreSQL or a broker without [New] or kafkatest.Start call it first.
func SkipInUnitRun(tb testing.TB) {
	tb.Helper()
	if os.Getenv(UnitEnv) != "" {
		tb.Skip("needs PostgreSQL or a Kafka broker: skipped in make test/unit")
	}
}

// New creates a fresh schema named after the test, and a pool bound to it.
// Both are removed when the test ends. maxConns 0 means [DefaultMaxConns].
func New(tb testing.TB, maxConns int32) *DB {
	tb.Helper()
	SkipInUnitRun(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	schema := SchemaName(tb.Name())
	admin, err := pgx.Connect(ctx, URL())
	if err != nil {
		tb.Fatalf("pgtest: connect %s: %v (is PostgreSQL running? see README)", URL(), err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		tb.Fatalf("pgtest: create schema: %v", err)
	}

	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	// A transaction a test leaves open holds back the server-wide xmin (vacuum,
	// and watermill-sql subscribers, which read below it): end it.
	cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "120s"
	if maxConns <= 0 {
		maxConns = DefaultMaxConns
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	url := URL()
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	db := &DB{Pool: pool, Schema: schema, URL: url + sep + "search_path=" + schema}
	tb.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, URL())
		if err != nil {
			tb.Errorf("pgtest: cleanup connect: %v", err)
			return
		}
		defer conn.Close(ctx)
		if os.Getenv("PGTEST_KEEP") != "" {
			tb.Logf("pgtest: kept schema %s", schema)
			return
		}
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			tb.Errorf("pgtest: drop schema %s: %v", schema, err)
		}
	})
	return db
}

// CountingPool returns a second pool on db's schema, of at most maxConns
// connections, whose PostgreSQL round trips are counted on rt. It never pings
// a connection on acquire (pgxpool does after a second idle, which would add
// a round trip). It is closed when the test or benchmark ends.
func (db *DB) CountingPool(tb testing.TB, maxConns int32, rt *rtcount.Counter) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.DialFunc = rt.DialFunc()
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("pgtest: counting pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// SQLDB returns a *sql.DB on db's schema opened with pgx's stdlib driver
// (what idem.SQLDB accepts), of at most maxConns connections; rt, when not
// nil, counts its round trips. It never pings a connection it reuses (stdlib
// does after a second idle, which would add a round trip). It is closed when
// the test or benchmark ends.
func (db *DB) SQLDB(tb testing.TB, maxConns int, rt *rtcount.Counter) *sql.DB {
	tb.Helper()
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	if rt != nil {
		cfg.DialFunc = rt.DialFunc()
	}
	sdb := stdlib.OpenDB(*cfg, stdlib.OptionShouldPing(func(context.Context, stdlib.ShouldPingParams) bool { return false }))
	sdb.SetMaxOpenConns(maxConns)
	sdb.SetMaxIdleConns(maxConns)
	tb.Cleanup(func() { _ = sdb.Close() })
	return sdb
}

// SchemaName turns a test name into a unique, valid schema name.
func SchemaName(testName string) string {
	var b strings.Builder
	b.WriteString("t_")
	for _, r := range strings.ToLower(testName) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	name := b.String()
	if len(name) > 40 {
		name = name[:40]
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	return name + "_" + hex.EncodeToString(rnd[:])
}

// Count returns SELECT count(*) of the query's rows; it fails the test on error.
func (db *DB) Count(tb testing.TB, query string, args ...any) int {
	tb.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM ("+query+") q", args...).Scan(&n); err != nil {
		tb.Fatalf("pgtest: count %q: %v", query, err)
	}
	return n
}

// Exec runs sql and fails the test on error.
func (db *DB) Exec(tb testing.TB, sql string, args ...any) {
	tb.Helper()
	if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatalf("pgtest: exec %q: %v", sql, err)
	}
}

// ForExample is New for testable Examples, which have no testing.TB: it
// creates a fresh schema named prefix_<random>, returns a pool whose
// search_path is that schema, and a cleanup that drops the schema and closes
// the pool. It panics on error.
func ForExample(ctx context.Context, prefix string) (pool *pgxpool.Pool, schema string, cleanup func()) {
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	schema = prefix + "_" + hex.EncodeToString(rnd[:])
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		panic(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = DefaultMaxConns
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		panic(err)
	}
	return pool, schema, func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
}
