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
	table := deduplicator.TableConfig{Schema: env.schema}
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(table)); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE payment (event_id uuid NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL)"); err != nil {
		return err
	}
	kafkaCfg := idemkafka.ClientConfig{Brokers: env.brokers}
	pubCfg, err := idemkafka.WatermillPublisherConfig(kafkaCfg) // idempotent producer, keyed by partition_key
	if err != nil {
		return err
	}
	subCfg, err := idemkafka.WatermillSubscriberConfig(kafkaCfg, env.group) // from the oldest offset
	if err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, logger)
	if err != nil {
		return err
	}
	defer kafkaPub.Close()

	// Produce: each event stamped with a UUIDv7 event_id, keyed by account.
	// Then the third event again, as Kafka redelivers it after a crash, and a
	// message from a producer that sets no event id.
	pub := publisher.NewStampingPublisher(kafkaPub)
	var events []*message.Message
	var wantCents int64
	for _, p := range []PaymentReceived{{"acct-1", 1250}, {"acct-2", 990}, {"acct-1", 4000}, {"acct-3", 120}, {"acct-2", 75}} {
		payload, _ := json.Marshal(p)
		events = append(events, publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), p.Account))
		wantCents += p.AmountCents
	}
	if err := pub.Publish(env.topic, events...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	dup := events[2].Copy() // stamped by now: a new message with the same event_id
	dup.UUID = watermill.NewUUID()
	noID := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct-9","amountCents":1}`))
	if err := kafkaPub.Publish(env.topic, dup, noID); err != nil { // the raw publisher: noID stays without an id
		return fmt.Errorf("publish duplicate and bad message: %w", err)
	}
	fmt.Printf("published %d events, re-published event %s once more, and 1 message without an event id\n\n",
		len(events), dup.Metadata.Get(publisher.MetadataEventID))

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
	if err := env.run(ctx, router, len(events)+2); err != nil { // until all 7 messages are accounted for
		return err
	}

	// Check the invariant: each event applied exactly once.
	var rows, distinct, claims int
	var cents int64
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id), coalesce(sum(amount_cents), 0),
		(SELECT count(*) FROM processed_event WHERE consumer_group = $1) FROM payment`, env.group).Scan(&rows, &distinct, &cents, &claims); err != nil {
		return err
	}
	fmt.Printf("\npayment rows: %d, distinct events: %d, processed_event rows: %d, total %d cents\nduplicates skipped: %d, poisoned: %d\n",
		rows, distinct, claims, cents, env.report.duplicates(), env.report.poisoned())
	if n := len(events); rows != n || distinct != n || claims != n || cents != wantCents || env.report.duplicates() != 1 || env.report.poisoned() != 1 {
		return fmt.Errorf("invariant broken: want %d payment rows, %d claims, %d cents, 1 duplicate skipped, 1 poisoned", n, n, wantCents)
	}
	fmt.Println("OK: every event applied exactly once; the redelivered duplicate was skipped.")
	return nil
}
