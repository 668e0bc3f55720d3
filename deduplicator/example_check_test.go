package deduplicator_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Check verifies the live table before claims rely on it. A table made with
// the reference recipe's DDL (PRIMARY KEY (event_id)) is refused with the
// fix; ConvertTable adopts it, keeping every row.
func ExampleCheck() {
	ctx := context.Background()
	pool, schema, cleanup := pgtest.ForExample(ctx, "example_check")
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}

	err := deduplicator.Check(ctx, pool, table)
	fmt.Println("missing:", errors.Is(err, deduplicator.ErrTableMissing))

	if _, err := pool.Exec(ctx, `CREATE TABLE processed_event (
		event_id       uuid        PRIMARY KEY,
		consumer_group text        NOT NULL,
		processed_at   timestamptz NOT NULL DEFAULT now());
		INSERT INTO processed_event (event_id, consumer_group) VALUES (gen_random_uuid(), 'billing')`); err != nil {
		panic(err)
	}
	err = deduplicator.Check(ctx, pool, table)
	var terr *migrate.TableError
	if errors.As(err, &terr) {
		fmt.Println("wrong key:", errors.Is(err, deduplicator.ErrTableKey))
		fmt.Println(terr.Problem)
	}

	res, err := deduplicator.ConvertTable(ctx, pool, table, deduplicator.ConvertOptions{})
	if err != nil {
		panic(err)
	}
	fmt.Printf("converted %d of %d rows\n", res.Kept, res.Rows)
	fmt.Println("check:", deduplicator.Check(ctx, pool, table))
	// Output:
	// missing: true
	// wrong key: true
	// primary key is (event_id), want (event_id, consumer_group): a second consumer group would skip every event another group already processed
	// converted 1 of 1 rows
	// check: <nil>
}
