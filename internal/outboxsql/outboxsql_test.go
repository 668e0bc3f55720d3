package outboxsql_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Positions go to and come from the pg_snapshot, xid8 and bigint columns
// unchanged in pgx's default mode and over the simple protocol (a
// connection pooler's), transaction ids beyond 32 bits included; a cut is
// read as pages and each page's rows in offset order.
func TestPositionRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "orders")))
	tables := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, "orders")
	require.NoError(t, ob.PoolPublisher(db.Pool).Publish("orders",
		message.NewMessage("m-1", []byte(`{}`)), message.NewMessage("m-2", []byte(`{}`)), message.NewMessage("m-3", []byte(`{}`))))

	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(db.URL)
			require.NoError(t, err)
			cfg.DefaultQueryExecMode = mode
			conn, err := pgx.ConnectConfig(ctx, cfg)
			require.NoError(t, err)
			defer conn.Close(ctx)
			name := "fwd-" + mode.String()

			_, err = tables.Position(ctx, conn, name)
			require.ErrorIs(t, err, outboxsql.ErrNoPosition)
			require.NoError(t, tables.Register(ctx, conn, name))
			p, err := tables.Position(ctx, conn, name)
			require.NoError(t, err)
			require.Equal(t, outboxsql.Position{Snapshot: outboxsql.Start}, p)
			tx, p2, err := tables.BeginLock(ctx, conn, name, outboxsql.Limits{})
			require.NoError(t, err)
			require.Equal(t, p, p2)
			require.Equal(t, byte('T'), conn.PgConn().TxStatus(), "BeginLock leaves the transaction open")
			require.NoError(t, tx.Commit(ctx))
			require.Equal(t, byte('I'), conn.PgConn().TxStatus())
			_, _, err = tables.BeginLock(ctx, conn, "never-registered", outboxsql.Limits{})
			require.ErrorIs(t, err, outboxsql.ErrNoPosition)
			require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "a failed BeginLock rolls back")

			cut, err := tables.ReadCut(ctx, conn, p, 2)
			require.NoError(t, err)
			require.Len(t, cut.Pages, 2, "3 rows in pages of 2")
			require.Equal(t, 2, cut.Pages[0].Rows)
			require.Equal(t, 1, cut.Pages[1].Rows)
			require.True(t, cut.To.Visible(cut.Pages[0].TxIDs[0]))
			rows, err := tables.ReadPage(ctx, conn, cut.Pages[0], nil)
			require.NoError(t, err)
			require.Len(t, rows, 2)
			require.Less(t, rows[0].Offset, rows[1].Offset)
			msg, err := rows[1].Message()
			require.NoError(t, err)
			require.Equal(t, "m-2", msg.UUID)

			// Part way through the cut: the rest of it is one page.
			mid := outboxsql.Position{Snapshot: p.Snapshot, Cut: &cut.To, CutOffset: cut.Pages[0].Last}
			require.NoError(t, tables.Ack(ctx, conn, name, mid))
			got, err := tables.Position(ctx, conn, name)
			require.NoError(t, err)
			require.Equal(t, mid.Snapshot.String(), got.Snapshot.String())
			require.Equal(t, cut.To.String(), got.Cut.String())
			require.Equal(t, mid.CutOffset, got.CutOffset)
			rest, err := tables.ReadCut(ctx, conn, got, 2)
			require.NoError(t, err)
			require.Len(t, rest.Pages, 1)
			require.Equal(t, cut.Pages[1].First, rest.Pages[0].First)
			pending, _, err := tables.Backlog(ctx, conn, name)
			require.NoError(t, err)
			require.EqualValues(t, 1, pending)

			ps, err := tables.Positions(ctx, conn, []string{name, name})
			require.NoError(t, err)
			require.Len(t, ps, 1)
			require.Equal(t, mid.Snapshot.String(), ps[0].Snapshot.String())
			_, err = tables.Positions(ctx, conn, []string{name, "never-registered"})
			require.ErrorIs(t, err, outboxsql.ErrNoPosition)

			// A snapshot with an epoch travels whole; it is ahead of this
			// cluster's transaction ids, so reading it is refused.
			far := outboxsql.Snapshot{Xmin: 1<<40 + 7, Xmax: 1<<40 + 20, Xip: []uint64{1<<40 + 7, 1<<40 + 9}}
			require.NoError(t, tables.Ack(ctx, conn, name, outboxsql.Position{Snapshot: far}))
			require.ErrorIs(t, tables.Ack(ctx, conn, "never-registered", outboxsql.Position{Snapshot: far}), outboxsql.ErrNoPosition)
			var stored, legacy string
			require.NoError(t, conn.QueryRow(ctx, `SELECT position_snapshot::text, last_processed_transaction_id::text || '/' || offset_acked FROM `+tables.Offsets+` WHERE consumer_group = $1`, name).Scan(&stored, &legacy))
			require.Equal(t, far.String(), stored)
			require.Equal(t, "1099511627782/9223372036854775807", legacy, "watermill-sql's columns: below far's xmin")
			_, err = tables.Position(ctx, conn, name)
			var fe *outboxsql.ForeignError
			require.ErrorAs(t, err, &fe)
			require.Equal(t, far.Xmax, fe.Stored.Xmax)
			require.False(t, fe.OtherSystem())
			_, _, err = tables.BeginLock(ctx, conn, name, outboxsql.Limits{})
			require.ErrorAs(t, err, &fe)
			require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "a refused BeginLock rolls back")
		})
	}
}

// A position of watermill-sql's kind (a subscriber's, or a forwarder's
// before migration 2) reads as the snapshot below its transaction plus the
// cut of that transaction's rows after its offset: nothing skipped, nothing
// resent.
func TestLegacyPosition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "orders")))
	tables := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, "orders")
	pub := ob.PoolPublisher(db.Pool)
	require.NoError(t, pub.Publish("orders", message.NewMessage("a-1", nil)))
	require.NoError(t, pub.Publish("orders", message.NewMessage("b-1", nil), message.NewMessage("b-2", nil), message.NewMessage("b-3", nil)))
	require.NoError(t, pub.Publish("orders", message.NewMessage("c-1", nil)))
	all, err := tables.ReadAll(ctx, db.Pool)
	require.NoError(t, err)
	require.Len(t, all, 5)
	b1 := all[1]
	db.Exec(t, `INSERT INTO `+tables.Offsets+` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('old', $1, $2::text::xid8)`, b1.Offset, strconv.FormatUint(b1.TxID, 10))

	p, err := tables.Position(ctx, db.Pool, "old")
	require.NoError(t, err)
	require.NotNil(t, p.Cut)
	var uuids []string
	read := func(p outboxsql.Position) {
		cut, err := tables.ReadCut(ctx, db.Pool, p, 10)
		require.NoError(t, err)
		for _, pg := range cut.Pages {
			rows, err := tables.ReadPage(ctx, db.Pool, pg, nil)
			require.NoError(t, err)
			for _, r := range rows {
				uuids = append(uuids, r.UUID)
			}
		}
	}
	read(p)                                    // the rest of b's transaction
	read(outboxsql.Position{Snapshot: *p.Cut}) // everything after it
	require.Equal(t, []string{"b-2", "b-3", "c-1"}, uuids)
	pending, _, err := tables.Backlog(ctx, db.Pool, "old")
	require.NoError(t, err)
	require.EqualValues(t, 3, pending)
}

func TestIntersect(t *testing.T) {
	t.Parallel()
	a := outboxsql.Snapshot{Xmin: 10, Xmax: 20, Xip: []uint64{10, 15}}
	b := outboxsql.Snapshot{Xmin: 12, Xmax: 18, Xip: []uint64{12, 17}}
	got := outboxsql.Intersect(a, b)
	for x := uint64(1); x < 30; x++ {
		require.Equal(t, a.Visible(x) && b.Visible(x), got.Visible(x), "xid %d in %s", x, got)
	}
	require.Equal(t, outboxsql.Start, outboxsql.Intersect())
	s, err := outboxsql.ParseSnapshot(got.String())
	require.NoError(t, err)
	require.Equal(t, got, s)
}
