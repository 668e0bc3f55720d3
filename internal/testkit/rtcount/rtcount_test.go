package rtcount_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
)

func TestCounter(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	t.Parallel()
	ctx := context.Background()
	c := &rtcount.Counter{}
	cfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.DialFunc = c.DialFunc()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close(ctx)
	require.Positive(t, c.Load(), "the startup exchange is counted")

	c.Reset()
	for range 3 {
		_, err := conn.Exec(ctx, "SELECT 1")
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, c.Load(), "three simple queries, three round trips")

	// Prepare once (one round trip), then a pipelined batch of three
	// statements is one round trip.
	b := &pgx.Batch{}
	for range 3 {
		b.Queue("SELECT $1::int", 1)
	}
	require.NoError(t, conn.SendBatch(ctx, b).Close())
	c.Reset()
	b = &pgx.Batch{}
	for range 3 {
		b.Queue("SELECT $1::int", 1)
	}
	require.NoError(t, conn.SendBatch(ctx, b).Close())
	require.EqualValues(t, 1, c.Load(), "a pipelined batch of prepared statements is one round trip")
}
