package idemtest_test

import (
	"context"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
)

// The kit's schema is the pool's search_path while the test runs, and gone
// (with the pool) once it ended; its broker answers a real Kafka client.
func TestKitSchemaAndKafka(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	t.Parallel()
	ctx := context.Background()
	var schema string
	t.Run("inner", func(t *testing.T) {
		pool, s := idemtest.Schema(t)
		schema = s
		var current string
		require.NoError(t, pool.QueryRow(ctx, "SELECT current_schema()").Scan(&current))
		require.Equal(t, s, current)
		_, err := pool.Exec(ctx, "CREATE TABLE ledger (id int)")
		require.NoError(t, err)

		brokers := idemtest.Kafka(t)
		client, err := sarama.NewClient(brokers, sarama.NewConfig())
		require.NoError(t, err)
		defer client.Close()
		require.NotEmpty(t, client.Brokers())
	})
	db := pgtest.New(t, 1)
	require.Equal(t, 0, db.Count(t, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema), "schema %s survived its test", schema)
}
