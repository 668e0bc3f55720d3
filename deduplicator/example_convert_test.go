package deduplicator_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// ConvertTable adopts a table whose rows do not all name their consumer
// group (here one whose consumer_group is nullable, filled by code that
// inserted only event_id). The rows without a group take the one
// ConvertOptions names; a dry run reports the counts first.
func ExampleConvertTable() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_convert")
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}
	if _, err := pool.Exec(ctx, `CREATE TABLE processed_event (event_id uuid PRIMARY KEY, consumer_group text, processed_at timestamptz DEFAULT now());
		INSERT INTO processed_event (event_id) VALUES (gen_random_uuid()), (gen_random_uuid());
		INSERT INTO processed_event (event_id, consumer_group) VALUES (gen_random_uuid(), 'notifications')`); err != nil {
		panic(err)
	}

	_, err := deduplicator.ConvertTable(ctx, pool, table, deduplicator.ConvertOptions{})
	var terr *migrate.TableError
	if errors.As(err, &terr) {
		fmt.Println(errors.Is(err, deduplicator.ErrTableColumns), terr.Problem)
	}

	res, err := deduplicator.ConvertTable(ctx, pool, table, deduplicator.ConvertOptions{ConsumerGroup: "billing", DryRun: true})
	if err != nil {
		panic(err)
	}
	fmt.Printf("dry run: %d rows, %d kept, %d merged, %d given the group\n", res.Rows, res.Kept, res.Collapsed, res.GroupFilled)

	if _, err := deduplicator.ConvertTable(ctx, pool, table, deduplicator.ConvertOptions{ConsumerGroup: "billing"}); err != nil {
		panic(err)
	}
	fmt.Println("check:", deduplicator.Check(ctx, pool, table))
	// Output:
	// true cannot convert: 2 rows have a NULL consumer_group and ConvertOptions.ConsumerGroup is empty
	// dry run: 3 rows, 3 kept, 0 merged, 2 given the group
	// check: <nil>
}
