package middleware

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// rtFixture is a one-connection pool whose round trips are counted at the
// net.Conn level, and a dedup middleware on it.
type rtFixture struct {
	pool  *pgxpool.Pool
	rt    *rtcount.Counter
	dedup *Dedup
	table deduplicator.TableConfig
}

func newRTFixture(t *testing.T, mode pgx.QueryExecMode) *rtFixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, "CREATE TABLE business (event_id uuid PRIMARY KEY)")

	rt := &rtcount.Counter{}
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.DialFunc = rt.DialFunc()
	cfg.ConnConfig.DefaultQueryExecMode = mode
	// No liveness ping on acquire: it would add a round trip after an idle second.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	d, err := NewDedup(Config{DB: pool, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)
	table.Table = "processed_event" // the default
	return &rtFixture{pool: pool, rt: rt, dedup: d, table: table}
}

// handle runs one message through the middleware around a handler that
// writes one business row, and returns the round trips it took and whether
// the handler ran.
func (f *rtFixture) handle(t *testing.T, id uuid.UUID) (roundTrips int64, ran bool) {
	t.Helper()
	h := f.dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ran = true
		_, err := MustTxFromContext(msg.Context()).Exec(msg.Context(), "INSERT INTO business (event_id) VALUES ($1)", id)
		return nil, err
	})
	msg := message.NewMessage(id.String(), []byte(`{}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	f.rt.Reset()
	_, err := h(msg)
	require.NoError(t, err)
	return f.rt.Load(), ran
}

// TestRoundTrips asserts the exact number of PostgreSQL round trips per
// message: BEGIN and the claim travel together, so a first-time message
// costs {BEGIN+claim}, the handler's own statements and COMMIT, and a
// duplicate costs {BEGIN+claim} and ROLLBACK.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			f := newRTFixture(t, mode)

			// Warm the connection: dial, and prepare the statements once.
			warm := uuid.Must(uuid.NewV7())
			f.handle(t, warm)
			f.handle(t, warm)

			id := uuid.Must(uuid.NewV7())
			n, ran := f.handle(t, id)
			require.True(t, ran)
			require.EqualValues(t, 3, n, "first-time message: {BEGIN + claim}, handler INSERT, COMMIT")

			n, ran = f.handle(t, id)
			require.False(t, ran, "a duplicate must not run the handler")
			require.EqualValues(t, 2, n, "duplicate: {BEGIN + claim}, ROLLBACK")

			var rows int
			require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT count(*) FROM business").Scan(&rows))
			require.Equal(t, 2, rows)
		})
	}
}

// TestClaimPreparedOncePerConn checks the statement cache: after many
// messages on one connection the claim exists once as a prepared statement.
func TestClaimPreparedOncePerConn(t *testing.T) {
	t.Parallel()
	f := newRTFixture(t, pgx.QueryExecModeCacheStatement)
	for range 5 {
		id := uuid.Must(uuid.NewV7())
		f.handle(t, id)
		f.handle(t, id)
	}
	var n int
	require.NoError(t, f.pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", claimsql.Claim(ident.Quote(f.table.Schema, f.table.Table))).Scan(&n))
	require.Equal(t, 1, n)
}

// TestDuplicateAssignsNoTransactionID checks that a duplicate writes no WAL,
// in a way other tests running at the same time cannot disturb: inside the
// duplicate's transaction, right before its rollback, no transaction id has
// been assigned (a transaction without one writes no heap, index or commit
// record). The first claim of the same id does get one, so the check can fail.
func TestDuplicateAssignsNoTransactionID(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newRTFixture(t, mode)
			id := uuid.Must(uuid.NewV7())

			xid := func(wantFirst bool, commit bool) *int64 {
				tx, first, err := f.dedup.dedup.BeginClaim(ctx, f.pool, pgx.TxOptions{}, id)
				require.NoError(t, err)
				require.Equal(t, wantFirst, first)
				var x *int64
				require.NoError(t, tx.QueryRow(ctx, "SELECT txid_current_if_assigned()").Scan(&x))
				if commit {
					require.NoError(t, tx.Commit(ctx))
				} else {
					require.NoError(t, tx.Rollback(ctx))
				}
				return x
			}
			require.NotNil(t, xid(true, true), "the first claim inserts a row, so it has a transaction id")
			require.Nil(t, xid(false, false), "a duplicate's claim must not assign a transaction id (no WAL)")
		})
	}
}

// TestRoundTrips_Conn: a single *pgx.Conn as DB takes the same one-round-trip
// path as a pool.
func TestRoundTrips_Conn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, "CREATE TABLE business (event_id uuid PRIMARY KEY)")
	rt := &rtcount.Counter{}
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.DialFunc = rt.DialFunc()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	d, err := NewDedup(Config{DB: conn, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)

	handle := func(id uuid.UUID) (int64, bool) {
		ran := false
		h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ran = true
			_, err := MustTxFromContext(msg.Context()).Exec(msg.Context(), "INSERT INTO business (event_id) VALUES ($1)", id)
			return nil, err
		})
		msg := message.NewMessage(id.String(), nil)
		msg.Metadata.Set(publisher.MetadataEventID, id.String())
		rt.Reset()
		_, err := h(msg)
		require.NoError(t, err)
		return rt.Load(), ran
	}
	warm := uuid.Must(uuid.NewV7())
	handle(warm)
	handle(warm)
	id := uuid.Must(uuid.NewV7())
	n, ran := handle(id)
	require.True(t, ran)
	require.EqualValues(t, 3, n)
	n, ran = handle(id)
	require.False(t, ran)
	require.EqualValues(t, 2, n)
	require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "the duplicate's transaction is closed")
}

// TestBeginClaimErrorReleasesConn: when the pipelined claim fails (here the
// table was dropped after the start-up check), the error carries the SQLSTATE, the transaction is
// rolled back and the pool's connection comes back usable.
func TestBeginClaimErrorReleasesConn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	table := deduplicator.TableConfig{Schema: db.Schema, Table: "dropped"}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	d, err := NewDedup(Config{DB: db.Pool, ConsumerGroup: "g", Table: table}, nil)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "DROP TABLE dropped")
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7())
	msg := message.NewMessage(id.String(), nil)
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	_, err = d.Middleware(func(*message.Message) ([]*message.Message, error) {
		t.Fatal("handler must not run")
		return nil, nil
	})(msg)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.UndefinedTable, pgErr.Code)
	require.Zero(t, db.Pool.Stat().AcquiredConns())
	var one int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT 1").Scan(&one))
}

// TestPipelinedClaimEveryExecMode: the pipelined {BEGIN + claim} works in
// every pgx exec mode a pool may be configured with, and a duplicate is
// skipped in each.
func TestPipelinedClaimEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			f := newRTFixture(t, mode)
			for range 2 {
				id := uuid.Must(uuid.NewV7())
				_, ran := f.handle(t, id)
				require.True(t, ran)
				_, ran = f.handle(t, id)
				require.False(t, ran)
			}
			var rows int
			require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT count(*) FROM business").Scan(&rows))
			require.Equal(t, 2, rows)
			require.Zero(t, f.pool.Stat().AcquiredConns())
		})
	}
}
