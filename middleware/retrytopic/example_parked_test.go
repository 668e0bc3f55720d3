package retrytopic_test

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// An operator's view of KeyOrder: the parked keys with their queues, and a
// key whose first event's copy was lost, sent again through the outbox.
func ExampleUnblock() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "retrytopic_unblock")
	defer cleanup()
	table := retrytopic.ParkedKeysTable{Schema: schema}
	if err := retrytopic.Migrate(ctx, pool, table); err != nil {
		panic(err)
	}
	ob, err := outbox.New(outbox.Config{Schema: schema, Topics: []string{"orders.retry"}}, nil)
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(ctx, pool); err != nil {
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

	sum, err := retrytopic.SummarizeParked(ctx, pool, table, "billing")
	if err != nil {
		panic(err)
	}
	fmt.Printf("keys %d, events %d, longest queue %d, copy overdue: %v\n",
		sum[0].Keys, sum[0].Events, sum[0].MaxQueue, sum[0].MaxHeadOverdue.Hours() >= 1.99)
	keys, err := retrytopic.ParkedKeys(ctx, pool, table, "billing", 10)
	if err != nil {
		panic(err)
	}
	fmt.Println(keys[0].Key, keys[0].Events, keys[0].Head, keys[0].HeadTopic)

	res, err := retrytopic.Unblock(ctx, pool, ob, table, "billing", "acct-42", nil)
	fmt.Println(res.Head, res.Topic, res.Resent, err)
	// Output:
	// keys 1, events 2, longest queue 2, copy overdue: true
	// acct-42 2 01900000-0000-7000-8000-000000000001 orders.retry
	// 01900000-0000-7000-8000-000000000001 orders.retry true <nil>
}
