package middleware_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// beginOnly is a Beginner that is neither a pool nor a conn: the middleware
// takes its two-statement path (BEGIN, then the claim).
type beginOnly struct{ migrate.Beginner }

// The pool path (BEGIN and the claim pipelined) and the plain Beginner path
// behave the same: first delivery commits, a duplicate is skipped and rolled
// back, a handler error rolls back and the redelivery processes once.
func TestBeginnerPathsBehaveAlike(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		db   func(f *ledgerFixture) migrate.Beginner
	}{
		{"pool", func(f *ledgerFixture) migrate.Beginner { return f.pool }},
		{"plain Beginner", func(f *ledgerFixture) migrate.Beginner { return beginOnly{f.pool} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			d := f.dedup(t, "billing", func(c *idem.Config) { c.DB = tc.db(f) })
			var calls atomic.Int32
			id := publisher.NewEventID()

			_, err := d.Middleware(f.failingHandler(1, &calls, errors.New("fail once")))(f.msg(id))
			require.Error(t, err)
			require.Zero(t, f.claims(t))

			h := d.Middleware(f.insertHandler(1, &calls))
			f.sql.reset()
			_, err = h(f.msg(id))
			require.NoError(t, err)
			require.Equal(t, 1, f.sql.count("commit"))
			f.sql.reset()
			_, err = h(f.msg(id))
			require.NoError(t, err)
			require.Equal(t, 1, f.sql.count("rollback"))
			require.Zero(t, f.sql.count("commit"))

			require.EqualValues(t, 2, calls.Load(), "the failed attempt and the redelivery")
			require.Equal(t, 1, f.ledgerRows(t))
			require.Equal(t, 1, f.claims(t))
			require.Zero(t, f.pool.Stat().AcquiredConns())
		})
	}
}

// Config.TxOptions reach the per-message transaction.
func TestTxOptionsApplied(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", func(c *idem.Config) { c.TxOptions = pgx.TxOptions{IsoLevel: pgx.Serializable} })
	var level string
	_, err := d.Middleware(func(m *message.Message) ([]*message.Message, error) {
		return nil, idem.MustTxFromContext(m.Context()).QueryRow(m.Context(), "SHOW transaction_isolation").Scan(&level)
	})(f.msg(publisher.NewEventID()))
	require.NoError(t, err)
	require.Equal(t, "serializable", level)
}

// With a pgx.Tx as DB each message runs in a savepoint of the caller's
// transaction: a handler error undoes only that message.
func TestSavepointPerMessageInCallerTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	outer, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = outer.Rollback(ctx) }()
	d := f.dedup(t, "billing", func(c *idem.Config) { c.DB = outer })
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(1, &calls))

	a, b := publisher.NewEventID(), publisher.NewEventID()
	_, err = h(f.msg(a))
	require.NoError(t, err)
	_, err = h(f.msg(a))
	require.NoError(t, err, "duplicate inside the same outer tx")
	_, err = d.Middleware(f.failingHandler(1, &calls, errors.New("boom")))(f.msg(b))
	require.Error(t, err)
	require.NoError(t, outer.Commit(ctx))

	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event"))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", a))
}

// TxOptions need a DB that can begin with options; otherwise NewDedup says
// so instead of silently running at the default isolation.
func TestTxOptionsRefusedWithoutBeginTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	outer, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = outer.Rollback(ctx) }()
	for _, db := range []migrate.Beginner{beginOnly{f.pool}, outer} {
		_, err := idem.NewDedup(idem.Config{DB: db, ConsumerGroup: "g", TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}}, nil)
		require.ErrorContains(t, err, "TxOptions", "%T", db)
	}
}

func TestNewDedupValidatesConfig(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	for _, tc := range []struct {
		cfg  idem.Config
		want string
	}{
		{idem.Config{ConsumerGroup: "g"}, "DB"},
		{idem.Config{DB: f.pool}, "ConsumerGroup"},
		{idem.Config{DB: f.pool, ConsumerGroup: "g", Table: deduplicator.TableConfig{Retention: -1}}, "Table.Retention: must not be negative"},
		{idem.Config{DB: f.pool, ConsumerGroup: "g", StaleMargin: 8 * 24 * time.Hour, Table: deduplicator.TableConfig{Schema: f.db.Schema}}, "StaleMargin: 192h0m0s must be shorter than the table's retention (168h0m0s)"},
		{idem.Config{DB: f.pool, ConsumerGroup: "g", Table: deduplicator.TableConfig{Table: `x"; DROP TABLE ledger; --`}}, "Table"},
	} {
		_, err := idem.NewDedup(tc.cfg, nil)
		require.ErrorContains(t, err, "invalid config")
		require.ErrorContains(t, err, tc.want)
		require.Equal(t, 1, strings.Count(err.Error(), "invalid config"), "read once: %v", err)
	}
}

// The zero values the docs call valid validate, and a bad field is named
// once, with its path.
func TestConfigValidateZeroValues(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	require.NoError(t, idem.Config{DB: f.pool, ConsumerGroup: "g"}.Validate())
	require.NoError(t, deduplicator.TableConfig{}.Validate())
	require.NoError(t, deduplicator.CleanerConfig{DB: f.pool}.Validate())
	require.NoError(t, outbox.Config{}.Validate())
	err := idem.Config{DB: f.pool, ConsumerGroup: "g", Table: deduplicator.TableConfig{Schema: "a b"}}.Validate()
	require.EqualError(t, err, `Table.Schema: "a b" is not a plain identifier (letters, digits, underscore; not starting with a digit)`)
	_, err = idem.NewDedup(idem.Config{DB: f.pool, ConsumerGroup: "g", Table: deduplicator.TableConfig{Schema: "a b"}}, nil)
	require.EqualError(t, err, `dedup: invalid config: Table.Schema: "a b" is not a plain identifier (letters, digits, underscore; not starting with a digit)`)
}
