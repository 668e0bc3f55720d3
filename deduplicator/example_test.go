package deduplicator_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// examplePool connects to DATABASE_URL (or the local test database) and
// returns a fresh schema name with a cleanup that drops it.
func examplePool(ctx context.Context) (*pgxpool.Pool, string, func()) {
	return pgtest.ForExample(ctx, "example_dedup")
}

// MigrationLine is the processed_event table's migrations: migrate.Up
// creates the table (and its schema) at start-up; calling it again, from any
// number of instances, is safe.
func ExampleMigrationLine() {
	ctx := context.Background()
	pool, schema, cleanup := examplePool(ctx)
	defer cleanup()

	table := deduplicator.TableConfig{Schema: schema} // Table defaults to processed_event
	for range 2 {
		if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
			panic(err)
		}
	}

	var versions int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "idem_schema_migration"}.Sanitize()).Scan(&versions)
	fmt.Println("applied versions:", versions)

	// The same SQL, rendered for goose or golang-migrate users.
	render, _ := migrate.New(nil, deduplicator.MigrationLine(table))
	migs, _ := render.Migrations()
	for _, m := range migs {
		fmt.Printf("%03d_%s\n", m.Version, m.Name)
	}
	// Output:
	// applied versions: 5
	// 001_processed_event
	// 002_retention_and_groups
	// 003_lease
	// 004_processed_at_index_non_v7
	// 005_progress
}

// Claim runs in the caller's transaction: commit it together with the
// business writes it protects. A second claim of the same event is a
// duplicate.
func ExampleDeduplicator_Claim() {
	ctx := context.Background()
	pool, schema, cleanup := examplePool(ctx)
	defer cleanup()
	table := deduplicator.TableConfig{Schema: schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		panic(err)
	}
	dedup, err := deduplicator.New(deduplicator.Config{TableConfig: table, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}

	eventID := publisher.NewEventID()
	for range 2 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			first, err := dedup.Claim(ctx, tx, eventID)
			if err != nil {
				return err
			}
			if !first {
				fmt.Println("duplicate: skip")
				return nil
			}
			// ... business writes on tx ...
			fmt.Println("first time: apply")
			return nil
		})
		if err != nil {
			panic(err)
		}
	}
	// Output:
	// first time: apply
	// duplicate: skip
}
