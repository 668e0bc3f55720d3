// Command quickstart shows the dedup middleware end to end: it publishes a
// few payment events to Kafka, re-publishes one of them (a redelivery: same
// event_id, new message, new offset) and one message without an event id,
// consumes them with a Watermill router (poison queue, retry, dedup) into a
// PostgreSQL table, prints what happened, and exits non-zero unless every
// event was applied exactly once.
//
// PostgreSQL: DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the program works
// in a schema of its own and drops it on exit. Kafka: KAFKA_BROKERS
// (comma-separated) when set, else an in-process Kafka-protocol broker
// (kfake) on 127.0.0.1.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// PaymentReceived is the event the demo publishes and applies.
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
	suffix := randomSuffix()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if os.Getenv("QUICKSTART_DEBUG") != "" {
		logger = watermill.NewStdLogger(true, false)
	}

	// PostgreSQL: a schema of our own, the processed_event table, the business table.
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	schema := "quickstart_" + suffix
	pool, err := openPool(ctx, dbURL, schema)
	if err != nil {
		return err
	}
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}()
	table := deduplicator.TableConfig{Schema: schema}
	if err := deduplicator.Migrate(ctx, pool, table); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE payment (
		event_id     uuid   NOT NULL,
		account      text   NOT NULL,
		amount_cents bigint NOT NULL
	)`); err != nil {
		return err
	}

	// Kafka: KAFKA_BROKERS, or an in-process broker.
	brokers, where, stop, err := startKafka()
	if err != nil {
		return err
	}
	defer stop()
	topic, poisonTopic, group := "payments-"+suffix, "payments-poison-"+suffix, "billing-"+suffix
	if err := createTopics(brokers, topic, poisonTopic); err != nil {
		return err
	}
	defer deleteTopics(brokers, topic, poisonTopic) // matters on a real cluster
	fmt.Printf("PostgreSQL schema %s, Kafka %s, topic %s, consumer group %s\n\n", schema, where, topic, group)

	pubCfg, err := publisher.NewKafkaPublisherConfig(publisher.KafkaConfig{Brokers: brokers})
	if err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, logger)
	if err != nil {
		return err
	}
	defer kafkaPub.Close()

	// Produce: five events, stamped with a UUIDv7 event_id and keyed by
	// account; then the third one again, as Kafka would redeliver it after a
	// crash; then a message from a producer that sets no event id.
	pub := publisher.NewStampingPublisher(kafkaPub)
	payments := []PaymentReceived{{"acct-1", 1250}, {"acct-2", 990}, {"acct-1", 4000}, {"acct-3", 120}, {"acct-2", 75}}
	var events []*message.Message
	var wantSum int64
	for _, p := range payments {
		payload, _ := json.Marshal(p)
		msg := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), p.Account)
		events = append(events, msg)
		wantSum += p.AmountCents
	}
	if err := pub.Publish(topic, events...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	dup := events[2].Copy()
	dup.UUID = watermill.NewUUID() // a new message, the same event_id
	if err := pub.Publish(topic, dup); err != nil {
		return fmt.Errorf("publish duplicate: %w", err)
	}
	noID := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct-9","amountCents":1}`))
	if err := kafkaPub.Publish(topic, noID); err != nil { // not stamped on purpose
		return fmt.Errorf("publish bad message: %w", err)
	}
	fmt.Printf("published %d events, re-published event %s once more, and 1 message without an event id\n\n",
		len(events), dup.Metadata.Get(publisher.MetadataEventID))

	// Consume: poison queue -> retry -> dedup -> handler.
	r := newReport()
	subCfg, err := publisher.NewKafkaSubscriberConfig(publisher.KafkaConfig{Brokers: brokers}, group)
	if err != nil {
		return err
	}
	sub, err := kafka.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: group, Table: table}, logger)
	if err != nil {
		return err
	}
	poison, err := middleware.PoisonQueueWithFilter(r.poisonPublisher(kafkaPub), poisonTopic, idem.IsPermanent)
	if err != nil {
		return err
	}
	retry := middleware.Retry{
		MaxRetries:      3,
		InitialInterval: 50 * time.Millisecond,
		ShouldRetry:     func(p middleware.RetryParams) bool { return !idem.IsPermanent(p.Err) },
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(poison, retry.Middleware, r.reportDuplicates, dedup.Middleware)
	router.AddConsumerHandler("apply-payment", topic, sub, func(msg *message.Message) error {
		var p PaymentReceived
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err)
		}
		ctx := msg.Context()
		eventID, _ := idem.EventIDFromContext(ctx)
		tx := idem.MustTxFromContext(ctx) // commits together with the event's claim
		if _, err := tx.Exec(ctx, "INSERT INTO payment (event_id, account, amount_cents) VALUES ($1, $2, $3)",
			eventID, p.Account, p.AmountCents); err != nil {
			return err
		}
		r.processed(msg, eventID.String(), p)
		return nil
	})
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()

	// Wait until every message is accounted for.
	want := len(events) + 2
	for r.seen() < want {
		select {
		case <-ctx.Done():
			_ = router.Close()
			return fmt.Errorf("timed out: %d of %d messages handled", r.seen(), want)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerDone; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}

	// The invariant: each event applied exactly once.
	var rows, distinct, claims int
	var sum int64
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT event_id), coalesce(sum(amount_cents), 0) FROM payment").Scan(&rows, &distinct, &sum); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM processed_event WHERE consumer_group = $1", group).Scan(&claims); err != nil {
		return err
	}
	fmt.Printf("\npayment rows: %d, distinct events: %d, processed_event rows: %d, total %d cents\n", rows, distinct, claims, sum)
	fmt.Printf("duplicates skipped: %d, poisoned: %d\n", r.duplicates(), r.poisoned())
	if rows != len(events) || distinct != len(events) || claims != len(events) || sum != wantSum || r.duplicates() != 1 || r.poisoned() != 1 {
		return fmt.Errorf("invariant broken: want %d payment rows, %d claims, %d cents, 1 duplicate skipped, 1 poisoned", len(events), len(events), wantSum)
	}
	fmt.Println("OK: every event applied exactly once; the redelivered duplicate was skipped.")
	return nil
}

// report prints and counts what happened to each message.
type report struct {
	mu        sync.Mutex
	ran       map[string]bool // message UUIDs whose handler committed
	nDup      int
	nPoisoned int
}

func newReport() *report { return &report{ran: map[string]bool{}} }

func (r *report) processed(msg *message.Message, eventID string, p PaymentReceived) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ran[msg.UUID] = true
	fmt.Printf("processed          event %s  %s  %5d cents\n", eventID, p.Account, p.AmountCents)
}

// reportDuplicates sits just outside the dedup middleware: a message acked
// without its handler having run was a duplicate.
func (r *report) reportDuplicates(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		r.mu.Lock()
		defer r.mu.Unlock()
		if err == nil && !r.ran[msg.UUID] {
			r.nDup++
			r.ran[msg.UUID] = true
			fmt.Printf("duplicate skipped  event %s  (message %s: already applied, handler not run)\n",
				msg.Metadata.Get(publisher.MetadataEventID), short(msg.UUID))
		}
		return out, err
	}
}

type poisonPublisher struct {
	r    *report
	next message.Publisher
}

func (p poisonPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.next.Publish(topic, msgs...); err != nil {
		return err
	}
	p.r.mu.Lock()
	defer p.r.mu.Unlock()
	for _, m := range msgs {
		p.r.nPoisoned++
		fmt.Printf("poisoned           message %s -> %s: %s\n", short(m.UUID), topic, m.Metadata.Get(middleware.ReasonForPoisonedKey))
	}
	return nil
}

func (p poisonPublisher) Close() error { return nil }

func (r *report) poisonPublisher(next message.Publisher) message.Publisher {
	return poisonPublisher{r: r, next: next}
}

func (r *report) seen() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ran) + r.nPoisoned
}

func (r *report) duplicates() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.nDup
}

func (r *report) poisoned() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.nPoisoned
}

func openPool(ctx context.Context, url, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w (is it running? set DATABASE_URL)", cfg.ConnConfig.Host, err)
	}
	return pool, nil
}

// startKafka returns KAFKA_BROKERS, or starts an in-process kfake broker.
func startKafka() (brokers []string, where string, stop func(), err error) {
	if v := strings.TrimSpace(os.Getenv("KAFKA_BROKERS")); v != "" {
		return strings.Split(v, ","), "at " + v, func() {}, nil
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		return nil, "", nil, fmt.Errorf("start in-process Kafka broker: %w", err)
	}
	return c.ListenAddrs(), "in-process (kfake) at " + strings.Join(c.ListenAddrs(), ","), c.Close, nil
}

func createTopics(brokers []string, topics ...string) error {
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return fmt.Errorf("kafka admin: %w", err)
	}
	defer admin.Close()
	for _, t := range topics {
		err := admin.CreateTopic(t, &sarama.TopicDetail{NumPartitions: 2, ReplicationFactor: 1}, false)
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	return nil
}

func deleteTopics(brokers []string, topics ...string) {
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return
	}
	defer admin.Close()
	for _, t := range topics {
		_ = admin.DeleteTopic(t)
	}
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// short abbreviates a message UUID (random, so its head is unique enough).
func short(id string) string {
	if len(id) > 8 {
		return id[:8]
	}
	return id
}
