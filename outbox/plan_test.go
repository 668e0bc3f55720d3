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

// The forwarder's read must not grow with the backlog: with 20,000 rows
// pending, reading a batch of 100 touches about 100 rows in index order,
// with no sort (watermill-sql's own query scans all 20,000 and sorts them).
func TestForwarderReadDoesNotScanTheBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	o, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"backlog"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(o.Config(), "backlog")))
	for k := 0; k < 20; k++ {
		msgs := make([]*message.Message, 1000)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprint(k, "-", i), []byte(`{}`))
		}
		require.NoError(t, o.PoolPublisher(db.Pool).Publish("backlog", msgs...))
	}
	db.Exec(t, "ANALYZE "+o.MessagesTable("backlog"))

	var plan []map[string]any
	var raw string
	require.NoError(t, db.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+outboxsql.ReadBatchSQL(o.MessagesTable("backlog")), uint64(0), int64(0), 100).Scan(&raw))
	require.NoError(t, json.Unmarshal([]byte(raw), &plan))
	var walk func(n map[string]any)
	nodes := 0
	walk = func(n map[string]any) {
		nodes++
		typ, _ := n["Node Type"].(string)
		require.NotEqual(t, "Sort", typ, "plan: %s", raw)
		if strings.Contains(typ, "Scan") {
			require.LessOrEqual(t, n["Actual Rows"].(float64), float64(100), "plan: %s", raw)
		}
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	walk(plan[0]["Plan"].(map[string]any))
	require.Positive(t, nodes)
}
