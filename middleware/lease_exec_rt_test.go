package middleware

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// TestCompleteExecRoundTrips counts the round trips of a completion batch
// (after its take): with CompleteExec statements it is one, whatever the
// batch's size; with Complete functions it grows by one per member.
func TestCompleteExecRoundTrips(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, "CREATE TABLE business (event_id uuid PRIMARY KEY)")
	rt := &rtcount.Counter{}
	pool := db.CountingPool(t, 3, rt)
	d, err := NewDedup(Config{DB: pool, ConsumerGroup: "g", Table: table, Mode: &LeaseConfig{Concurrency: 1}}, nil)
	require.NoError(t, err)
	l := d.strategy.(*leaseMode)
	const insert = "INSERT INTO business (event_id) VALUES ($1)"
	exec := func(id uuid.UUID) write { return write{sql: insert, args: []any{id}} }
	fn := func(id uuid.UUID) write {
		return write{fn: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, insert, id)
			return err
		}}
	}
	// complete takes n leases, then completes them in one batch and
	// returns that completion's round trips.
	complete := func(n int, w func(uuid.UUID) write) int64 {
		reqs := make([]leasesql.Request, n)
		batch := make([]*completeReq, n)
		for i := range reqs {
			reqs[i] = leasesql.Request{EventID: publisher.NewEventID(), Token: uuid.New()}
			batch[i] = &completeReq{origCtx: ctx, msg: message.NewMessage(uuid.NewString(), nil), id: reqs[i].EventID, token: reqs[i].Token,
				writes: []write{w(reqs[i].EventID)}}
		}
		_, err := l.proto.Take(ctx, pool, reqs, time.Minute, "test")
		require.NoError(t, err)
		rt.Reset()
		require.NoError(t, l.completeBatch(batch))
		for _, c := range batch {
			require.NoError(t, c.err)
			require.Equal(t, leasesql.Completed, c.result)
		}
		return rt.Load()
	}
	complete(1, exec) // the connection prepares the statements once
	complete(1, fn)
	one, many := complete(1, exec), complete(32, exec)
	require.EqualValues(t, 1, one, "the check, the claims and the statements, one implicit transaction")
	require.Equal(t, one, many, "not one more per member")
	one, many = complete(1, fn), complete(32, fn)
	require.Equal(t, one+31, many, "Complete's functions: one round trip each")
	require.Equal(t, 2+1+32+1+32, db.Count(t, "SELECT 1 FROM business"))
}
