package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// The forwarder's reads follow the cut, not the table: with 20,000 rows
// already forwarded, and one transaction that wrote early still open, the
// read of a cut of 100 new rows touches about 100 rows (the keys of the
// cut, then one page), never the forwarded ones.
func TestForwarderReadDoesNotScanTheBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 3)
	o, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"backlog"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(o.Config(), "backlog")))
	tables := outboxsql.Tables{Messages: o.MessagesTable("backlog"), Offsets: outbox.OffsetsTable(o, "backlog")}
	publish := func(prefix string, n int) {
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprint(prefix, "-", i), []byte(`{}`))
		}
		require.NoError(t, o.PoolPublisher(db.Pool).Publish("backlog", msgs...))
	}
	// An open transaction that wrote a row before everything else.
	open, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer open.Rollback(ctx)
	require.NoError(t, o.Publisher(open).Publish("backlog", message.NewMessage("open", []byte(`{}`))))
	for k := 0; k < 20; k++ {
		publish(fmt.Sprint(k), 1000)
	}
	var forwarded string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&forwarded))
	publish("new", 100)
	db.Exec(t, "ANALYZE "+tables.Messages)

	explain := func(sql string, args ...any) {
		t.Helper()
		var plan []map[string]any
		var raw string
		require.NoError(t, db.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+sql, args...).Scan(&raw))
		require.NoError(t, json.Unmarshal([]byte(raw), &plan))
		var walk func(n map[string]any)
		walk = func(n map[string]any) {
			typ, _ := n["Node Type"].(string)
			if strings.Contains(typ, "Scan") {
				require.LessOrEqual(t, n["Actual Rows"].(float64), float64(101), "plan: %s", raw)
			}
			children, _ := n["Plans"].([]any)
			for _, c := range children {
				walk(c.(map[string]any))
			}
		}
		walk(plan[0]["Plan"].(map[string]any))
	}
	explain(outboxsql.CutSQL(tables.Messages), forwarded, nil, int64(0))

	from, err := outboxsql.ParseSnapshot(forwarded)
	require.NoError(t, err)
	cut, err := tables.ReadCut(ctx, db.Pool, outboxsql.Position{Snapshot: from}, 1000)
	require.NoError(t, err)
	require.Len(t, cut.Pages, 1)
	require.Equal(t, 100, cut.Pages[0].Rows)
	pg := cut.Pages[0]
	xids := make([]string, len(pg.TxIDs))
	for i, x := range pg.TxIDs {
		xids[i] = fmt.Sprint(x)
	}
	explain(outboxsql.PageSQL(tables.Messages), xids, pg.First, pg.Last)
}
