package outboxsql_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// A cut's first page read in the cut's round trip is the page ReadPage
// reads, for a new cut and for the rest of one in progress, in pgx's
// default mode and over the simple protocol; AckAndReadCut moves the
// position and reads the cut after it (none while no row committed since,
// then the new row).
func TestFirstPageWithTheCut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "orders")))
	tables := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, "orders")
	pub := ob.PoolPublisher(db.Pool)
	// Two transactions: the cut holds both, in offset order.
	require.NoError(t, pub.Publish("orders", message.NewMessage("a-1", []byte(`{}`)), message.NewMessage("a-2", []byte(`{}`)), message.NewMessage("a-3", []byte(`{}`))))
	require.NoError(t, pub.Publish("orders", message.NewMessage("b-1", []byte(`{}`)), message.NewMessage("b-2", []byte(`{}`))))

	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(db.URL)
			require.NoError(t, err)
			cfg.DefaultQueryExecMode = mode
			conn, err := pgx.ConnectConfig(ctx, cfg)
			require.NoError(t, err)
			defer conn.Close(ctx)
			name := "fwd-" + mode.String()
			require.NoError(t, tables.Register(ctx, conn, name))

			tx, p, err := tables.BeginLock(ctx, conn, name, outboxsql.Limits{})
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			cut, dead, first, err := tables.ReadCutDeadKeysAndFirstPage(ctx, tx, p, 2)
			require.NoError(t, err)
			require.NotNil(t, dead)
			require.Len(t, cut.Pages, 3, "5 rows in pages of 2")
			requireSamePage(t, tx, tables, cut.Pages[0], first, "a-1", "a-2")

			// The rest of the cut, after its first page.
			mid := outboxsql.Position{Snapshot: p.Snapshot, Cut: &cut.To, CutOffset: cut.Pages[0].Last}
			rest, _, first, err := tables.ReadCutDeadKeysAndFirstPage(ctx, tx, mid, 2)
			require.NoError(t, err)
			require.Len(t, rest.Pages, 2)
			requireSamePage(t, tx, tables, rest.Pages[0], first, "a-3", "b-1")

			// Past the cut: nothing new yet.
			end := outboxsql.Position{Snapshot: cut.To}
			next, _, first, err := tables.AckAndReadCut(ctx, tx, name, end, 2)
			require.NoError(t, err)
			require.Empty(t, next.Pages)
			require.Nil(t, first)
			got, err := tables.Position(ctx, tx, name)
			require.NoError(t, err)
			require.Equal(t, end.Snapshot.String(), got.Snapshot.String(), "the position moved in the same round trip")
			require.Nil(t, got.Cut)

			// A row committed since: the next cut is that row.
			require.NoError(t, pub.Publish("orders", message.NewMessage("c-"+mode.String(), []byte(`{}`))))
			next, _, first, err = tables.AckAndReadCut(ctx, tx, name, end, 2)
			require.NoError(t, err)
			require.Len(t, next.Pages, 1)
			requireSamePage(t, tx, tables, next.Pages[0], first, "c-"+mode.String())
			require.NoError(t, tx.Commit(ctx))

			tx, _, err = tables.BeginLock(ctx, conn, name, outboxsql.Limits{})
			require.NoError(t, err)
			_, _, _, err = tables.AckAndReadCut(ctx, tx, "never-registered", end, 2)
			require.ErrorIs(t, err, outboxsql.ErrNoPosition)
			tx.Rollback(ctx)
		})
	}
}

// requireSamePage checks that first holds the rows ReadPage reads for
// page, with the given UUIDs.
func requireSamePage(t *testing.T, tx dbx.Querier, tables outboxsql.Tables, page outboxsql.Page, first []outboxsql.Row, uuids ...string) {
	t.Helper()
	want, err := tables.ReadPage(context.Background(), tx, page, nil)
	require.NoError(t, err)
	require.Equal(t, want, first)
	var got []string
	for _, r := range first {
		got = append(got, r.UUID)
	}
	require.Equal(t, uuids, got)
}
