package outboxsql_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Positions go to and come from the xid8 and bigint columns unchanged in
// pgx's default mode and over the simple protocol (a connection pooler's),
// transaction ids beyond 32 bits included.
func TestPositionRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "orders")))
	tables := outboxsql.Tables{Messages: ob.MessagesTable("orders"), Offsets: ob.OffsetsTable("orders")}
	require.NoError(t, ob.PoolPublisher(db.Pool).Publish("orders",
		message.NewMessage("m-1", []byte(`{}`)), message.NewMessage("m-2", []byte(`{}`))))
	var xid string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT transaction_id::text FROM `+tables.Messages+` LIMIT 1`).Scan(&xid))
	txID, err := strconv.ParseUint(xid, 10, 64)
	require.NoError(t, err)
	// The rows are read below the server's xmin, which a transaction of a
	// test running in parallel may hold back for a while.
	require.Eventually(t, func() bool {
		var visible bool
		err := db.Pool.QueryRow(ctx, `SELECT $1::xid8 < pg_snapshot_xmin(pg_current_snapshot())`, txID).Scan(&visible)
		return err == nil && visible
	}, time.Minute, 10*time.Millisecond)

	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(db.URL)
			require.NoError(t, err)
			cfg.DefaultQueryExecMode = mode
			conn, err := pgx.ConnectConfig(ctx, cfg)
			require.NoError(t, err)
			defer conn.Close(ctx)
			name := "fwd-" + mode.String()

			_, err = tables.Lock(ctx, conn, name)
			require.ErrorIs(t, err, pgx.ErrNoRows)
			require.NoError(t, tables.Register(ctx, conn, name))
			p, err := tables.Lock(ctx, conn, name)
			require.NoError(t, err)
			require.Equal(t, outboxsql.Position{}, p)

			rows, err := tables.ReadBatch(ctx, conn, p, 10, nil)
			require.NoError(t, err)
			require.Len(t, rows, 2)
			require.Equal(t, txID, rows[0].Position.TxID)
			require.Less(t, rows[0].Position.Offset, rows[1].Position.Offset)
			msg, err := rows[1].Message()
			require.NoError(t, err)
			require.Equal(t, "m-2", msg.UUID)
			rows, err = tables.ReadBatch(ctx, conn, rows[0].Position, 10, nil)
			require.NoError(t, err)
			require.Len(t, rows, 1, "keyset read after the first row")

			far := outboxsql.Position{TxID: 1<<40 + 7, Offset: 1<<33 + 1}
			require.NoError(t, tables.Ack(ctx, conn, name, far))
			p, err = tables.Lock(ctx, conn, name)
			require.NoError(t, err)
			require.Equal(t, far, p)
			rows, err = tables.ReadBatch(ctx, conn, far, 10, nil)
			require.NoError(t, err)
			require.Empty(t, rows)

			low, err := tables.Lowest(ctx, conn, []string{name})
			require.NoError(t, err)
			require.Equal(t, far, low)
			_, err = tables.Lowest(ctx, conn, []string{name, "never-registered"})
			require.ErrorIs(t, err, outboxsql.ErrNoPosition)
			pending, _, err := tables.Backlog(ctx, conn, name)
			require.NoError(t, err)
			require.Zero(t, pending)
		})
	}
}
