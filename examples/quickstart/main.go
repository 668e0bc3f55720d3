// Command quickstart is the dedup middleware end to end: it publishes five
// payment events to Kafka, one of them twice, and a message without an event
// id; consumes them into PostgreSQL through a Watermill router; and exits
// non-zero unless every event was applied exactly once. This file is the
// lesson; infra.go gives it a schema, topics and a broker of its own.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// PaymentReceived is the event the quickstart publishes and applies.
type PaymentReceived struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amountCents"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart: FAILED:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	env, err := setUp(ctx) // infra.go
	if err != nil {
		return err
	}
	defer env.tearDown()
	pool, logger := env.pool, env.logger // a pool whose search_path is the schema of this run

	// Set up: the processed_event table (before idem.NewDedup, which checks
	// it), the business table, and Kafka configs with safe settings.
	table, err := createTables(ctx, env)
	if err != nil {
		return err
	}
	kafkaCfg := idemkafka.ClientConfig{Brokers: env.brokers}
	pubCfg, err := idemkafka.WatermillPublisherConfig(kafkaCfg) // idempotent producer, keyed by partition_key
	if err != nil {
		return err
	}
	// The subscriber keeps the group's position in PostgreSQL beside the
	// claims, and starts from it: a failover to an asynchronous standby or
	// a point-in-time restore then skips no event.
	subKafkaCfg := kafkaCfg
	subKafkaCfg.Progress, subKafkaCfg.ProgressSchema = pool, env.schema
	subCfg, err := idemkafka.WatermillSubscriberConfig(subKafkaCfg, env.group) // from the oldest offset
	if err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, logger)
	if err != nil {
		return err
	}
	defer kafkaPub.Close()

	// Produce: the events, a redelivered duplicate and a message without an id.
	n, wantCents, err := produce(env, kafkaPub)
	if err != nil {
		return err
	}

	// Consume: poison queue → retry → dedup → handler. The handler writes
	// through the middleware's transaction, which also holds the event's claim.
	sub, err := kafka.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: env.group, Table: table}, logger)
	if err != nil {
		return err
	}
	poison, err := middleware.PoisonQueueWithFilter(env.report.poisonPublisher(kafkaPub), env.poisonTopic, idem.IsPermanent)
	if err != nil {
		return err
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: 50 * time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(poison, retry.Middleware, env.report.reportDuplicates, dedup.Middleware)
	router.AddConsumerHandler("apply-payment", env.topic, sub, func(msg *message.Message) error {
		var p PaymentReceived
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err) // permanent: poisoned, not retried
		}
		ctx := msg.Context()
		eventID, _ := idem.EventIDFromContext(ctx)
		tx := idem.MustTxFromContext(ctx) // commits together with the event's claim
		if _, err := tx.Exec(ctx, "INSERT INTO payment (event_id, account, amount_cents) VALUES ($1, $2, $3)",
			eventID, p.Account, p.AmountCents); err != nil {
			return err
		}
		env.report.processed(msg, eventID.String(), p.Account, p.AmountCents)
		return nil
	})
	if err := env.run(ctx, router, n+2); err != nil { // until all 7 messages are accounted for
		return err
	}

	return checkExactlyOnce(ctx, env, n, wantCents)
}

// createTables creates the processed_event table (before idem.NewDedup,
// which checks it) and the business table in the run's schema.
func createTables(ctx context.Context, env *infra) (deduplicator.TableConfig, error) {
	table := deduplicator.TableConfig{Schema: env.schema}
	if err := migrate.Up(ctx, env.pool, deduplicator.MigrationLine(table)); err != nil {
		return table, fmt.Errorf("migrate: %w", err)
	}
	if _, err := env.pool.Exec(ctx, "CREATE TABLE payment (event_id uuid NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL)"); err != nil {
		return table, err
	}
	return table, nil
}

// produce publishes the events, each stamped with a UUIDv7 event_id and
// keyed by account, then the third event again, as Kafka redelivers it after
// a crash, and a message from a producer that sets no event id. It returns
// the number of events and their total amount.
func produce(env *infra, kafkaPub message.Publisher) (int, int64, error) {
	pub := publisher.NewStampingPublisher(kafkaPub)
	var events []*message.Message
	var wantCents int64
	for _, p := range []PaymentReceived{{"acct-1", 1250}, {"acct-2", 990}, {"acct-1", 4000}, {"acct-3", 120}, {"acct-2", 75}} {
		payload, _ := json.Marshal(p)
		events = append(events, publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), p.Account))
		wantCents += p.AmountCents
	}
	if err := pub.Publish(env.topic, events...); err != nil {
		return 0, 0, fmt.Errorf("publish: %w", err)
	}
	dup := events[2].Copy() // stamped by now: a new message with the same event_id
	dup.UUID = watermill.NewUUID()
	noID := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct-9","amountCents":1}`))
	if err := kafkaPub.Publish(env.topic, dup, noID); err != nil { // the raw publisher: noID stays without an id
		return 0, 0, fmt.Errorf("publish duplicate and bad message: %w", err)
	}
	fmt.Printf("published %d events, re-published event %s once more, and 1 message without an event id\n\n",
		len(events), dup.Metadata.Get(publisher.MetadataEventID))
	return len(events), wantCents, nil
}

// checkExactlyOnce checks the invariant: each of the n events applied
// exactly once, the duplicate skipped and the message without an id poisoned.
func checkExactlyOnce(ctx context.Context, env *infra, n int, wantCents int64) error {
	var rows, distinct, claims int
	var cents int64
	if err := env.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id), coalesce(sum(amount_cents), 0),
		(SELECT count(*) FROM processed_event WHERE consumer_group = $1) FROM payment`, env.group).Scan(&rows, &distinct, &cents, &claims); err != nil {
		return err
	}
	fmt.Printf("\npayment rows: %d, distinct events: %d, processed_event rows: %d, total %d cents\nduplicates skipped: %d, poisoned: %d\n",
		rows, distinct, claims, cents, env.report.duplicates(), env.report.poisoned())
	if rows != n || distinct != n || claims != n || cents != wantCents || env.report.duplicates() != 1 || env.report.poisoned() != 1 {
		return fmt.Errorf("invariant broken: want %d payment rows, %d claims, %d cents, 1 duplicate skipped, 1 poisoned", n, n, wantCents)
	}
	fmt.Println("OK: every event applied exactly once; the redelivered duplicate was skipped.")
	return nil
}
