package parkedsql_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The operator's view of KeyOrder: the parked keys with their queues and
// first events, and a summary per group; a copy due two hours ago is
// overdue by that much.
func TestKeysAndSummary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(ctx, db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema})))
	// What KeyOrder leaves when a key's first event fails and its copy never
	// comes back: that event (its copy due two hours ago) and one waiting
	// behind it.
	head := uuid.MustParse("01900000-0000-7000-8000-000000000001")
	db.Exec(t, `INSERT INTO retry_parked_key
(consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata) VALUES
('billing', 'acct-42', $1, 'orders.retry', now() - interval '2 hours', 'm0', '{}', '{"event_id": "01900000-0000-7000-8000-000000000001", "retry_attempt": "1", "retry_error": "boom"}'),
('billing', 'acct-42', '01900000-0000-7000-8000-000000000002', NULL, NULL, 'm1', '{}', '{"event_id": "01900000-0000-7000-8000-000000000002", "retry_attempt": "0"}')`, head)
	check := deduplicator.ValidateGroupName

	sum, err := parkedsql.Summarize(ctx, db.Pool, db.Schema, "", "billing", check)
	require.NoError(t, err)
	require.Len(t, sum, 1)
	require.Equal(t, "billing", sum[0].ConsumerGroup)
	require.EqualValues(t, 1, sum[0].Keys)
	require.EqualValues(t, 2, sum[0].Events)
	require.EqualValues(t, 2, sum[0].MaxQueue)
	require.GreaterOrEqual(t, sum[0].MaxHeadOverdue, 119*time.Minute)

	keys, err := parkedsql.Keys(ctx, db.Pool, db.Schema, parkedsql.DefaultTable, "", 10, check)
	require.NoError(t, err)
	require.Len(t, keys, 1)
	k := keys[0]
	require.Equal(t, "acct-42", k.Key)
	require.EqualValues(t, 2, k.Events)
	require.Equal(t, head, k.Head)
	require.Equal(t, "orders.retry", k.HeadTopic)
	require.Equal(t, 1, k.HeadAttempt)
	require.Equal(t, "boom", k.HeadError)
	require.GreaterOrEqual(t, k.HeadOverdue, 119*time.Minute)

	none, err := parkedsql.Keys(ctx, db.Pool, db.Schema, "", "shipping", 0, check)
	require.NoError(t, err)
	require.Empty(t, none)

	// Names are checked before any statement.
	_, err = parkedsql.Keys(ctx, db.Pool, db.Schema, "bad name", "billing", 0, check)
	require.ErrorContains(t, err, "Table")
	_, err = parkedsql.Summarize(ctx, db.Pool, db.Schema, "", "bill\x00ing", check)
	require.ErrorIs(t, err, deduplicator.ErrInvalidGroupName)
	_, err = parkedsql.Summarize(ctx, db.Pool, db.Schema, "", "billing", func(field, _ string) error { return errors.New(field + " refused") })
	require.ErrorContains(t, err, "consumerGroup refused")
}
