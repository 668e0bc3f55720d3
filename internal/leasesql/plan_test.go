package leasesql_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Every statement of a take and of the fast path reaches the claim table
// through its primary key, whatever the plan cache picks: a seq scan of
// the claim table on every take (a hashed EXISTS subplan, which PostgreSQL
// picked for the state read while the table had tens of thousands of rows
// and no statistics yet) costs milliseconds per batch and grows with the
// table.
func TestStatementsReadClaimsByIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	p := leasesql.New(db.Schema, "processed_event", "billing")
	db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group) SELECT gen_random_uuid(), 'billing' FROM generate_series(1, 30000)")
	ids, toks := make([]uuid.UUID, 64), make([]uuid.UUID, 64)
	for i := range ids {
		ids[i], toks[i] = publisher.NewEventID(), uuid.New()
	}
	statements := leasesql.Statements(p, ids, toks, time.Minute)
	// Before the table's first ANALYZE (the planner guesses its size from
	// its pages), then after it.
	for _, mode := range []string{"force_custom_plan", "force_generic_plan", "analyze", "force_custom_plan", "force_generic_plan"} {
		if mode == "analyze" {
			db.Exec(t, "ANALYZE processed_event")
			continue
		}
		for name, st := range statements {
			tx, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			var plan string
			_, err = tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode)
			if err == nil {
				err = tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+st.SQL, st.Args...).Scan(&plan)
			}
			_ = tx.Rollback(ctx)
			require.NoError(t, err, name)
			require.NotRegexp(t, `"Node Type": "Seq Scan",[^}]*"Relation Name": "processed_event"`, plan,
				"%s (%s) scans the claim table", name, mode)
		}
	}
}
