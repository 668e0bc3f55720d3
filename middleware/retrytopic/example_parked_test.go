package retrytopic_test

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// A key whose first event's copy was lost (idemctl retry parked shows it
// overdue), sent again through the outbox.
func ExampleUnblock() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "retrytopic_unblock")
	defer cleanup()
	table := retrytopic.ParkedKeysTable{Schema: schema}
	if err := migrate.Up(ctx, pool, retrytopic.MigrationLine(table)); err != nil {
		panic(err)
	}
	ob, err := outbox.New(outbox.Config{Schema: schema, Topics: []string{"orders.retry"}}, nil)
	if err != nil {
		panic(err)
	}
	if err := migrate.Up(ctx, pool, outbox.MigrationLine(ob.Config(), "orders.retry")); err != nil {
		panic(err)
	}
	// What KeyOrder leaves when a key's first event fails and its copy never
	// comes back: that event (its copy due two hours ago) and one waiting
	// behind it.
	head := uuid.MustParse("01900000-0000-7000-8000-000000000001")
	if _, err := pool.Exec(ctx, `INSERT INTO `+schema+`.retry_parked_key
(consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata) VALUES
('billing', 'acct-42', $1, 'orders.retry', now() - interval '2 hours', 'm0', '{}', '{"event_id": "01900000-0000-7000-8000-000000000001", "retry_attempt": "1"}'),
('billing', 'acct-42', '01900000-0000-7000-8000-000000000002', NULL, NULL, 'm1', '{}', '{"event_id": "01900000-0000-7000-8000-000000000002", "retry_attempt": "0"}')`, head); err != nil {
		panic(err)
	}

	res, err := retrytopic.Unblock(ctx, pool, ob, table, "billing", "acct-42", nil)
	fmt.Println(res.Head, res.Topic, res.Resent, err)
	// Output:
	// 01900000-0000-7000-8000-000000000001 orders.retry true <nil>
}
