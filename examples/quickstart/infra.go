package main

// This file is what the quickstart needs to run anywhere, and not the lesson:
// a PostgreSQL schema and Kafka topics of its own (removed on exit), an
// in-process Kafka-protocol broker when KAFKA_BROKERS is unset, and a report
// that prints what happened to each message and tells when all of them are
// accounted for.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// infra is where the quickstart runs: a pool whose search_path is a fresh
// schema, Kafka brokers, uniquely named topics and consumer group, a logger,
// and the report.
type infra struct {
	pool        *pgxpool.Pool
	brokers     []string
	schema      string
	topic       string
	poisonTopic string
	group       string
	logger      watermill.LoggerAdapter
	report      *report

	cleanups []func() // run in reverse order by tearDown
}

// setUp creates the schema (DATABASE_URL, default defaultDatabaseURL), starts
// or reaches the broker (KAFKA_BROKERS, else kfake), creates the topics and
// prints where the quickstart runs. On error it undoes what it did.
func setUp(ctx context.Context) (_ *infra, err error) {
	suffix := randomSuffix()
	in := &infra{
		schema:      "quickstart_" + suffix,
		topic:       "payments-" + suffix,
		poisonTopic: "payments-poison-" + suffix,
		group:       "billing-" + suffix,
		logger:      watermill.NopLogger{},
		report:      &report{ran: map[string]bool{}},
	}
	if os.Getenv("QUICKSTART_DEBUG") != "" {
		in.logger = watermill.NewStdLogger(true, false)
	}
	defer func() {
		if err != nil {
			in.tearDown()
		}
	}()

	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = in.schema
	if in.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	in.cleanups = append(in.cleanups, in.pool.Close)
	if _, err := in.pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{in.schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("PostgreSQL at %s: %w (is it running? set DATABASE_URL)", cfg.ConnConfig.Host, err)
	}
	in.cleanups = append(in.cleanups, func() {
		_, _ = in.pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{in.schema}.Sanitize()+" CASCADE")
	})

	brokers, stopKafka, err := idemtest.StartKafka() // KAFKA_BROKERS, else an in-process broker
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka broker: %w", err)
	}
	in.cleanups = append(in.cleanups, stopKafka)
	in.brokers = brokers
	where := "at " + strings.Join(in.brokers, ",")
	if os.Getenv("KAFKA_BROKERS") == "" {
		where = "in-process (kfake) " + where
	}
	for _, t := range []string{in.topic, in.poisonTopic} {
		if err := createTopic(in.brokers, t, 2); err != nil {
			return nil, fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	in.cleanups = append(in.cleanups, func() { deleteTopics(in.brokers, in.topic, in.poisonTopic) }) // matters on a real cluster
	fmt.Printf("PostgreSQL schema %s, Kafka %s, topic %s, consumer group %s\n\n", in.schema, where, in.topic, in.group)
	return in, nil
}

// tearDown deletes the topics, drops the schema and stops the broker.
func (in *infra) tearDown() {
	for i := len(in.cleanups) - 1; i >= 0; i-- {
		in.cleanups[i]()
	}
}

// run runs router until the report has accounted for want messages (each
// processed, skipped as a duplicate or poisoned), then closes it.
func (in *infra) run(ctx context.Context, router *message.Router, want int) error {
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-done:
		return fmt.Errorf("router: %w", err)
	}
	for in.report.seen() < want {
		select {
		case <-ctx.Done():
			_ = router.Close()
			<-done
			return fmt.Errorf("timed out: %d of %d messages handled", in.report.seen(), want)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// report prints and counts what happened to each message.
type report struct {
	mu        sync.Mutex
	ran       map[string]bool // message UUIDs whose handler ran
	nDup      int
	nPoisoned int
}

// processed is called by the handler.
func (r *report) processed(msg *message.Message, eventID string, account string, cents int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ran[msg.UUID] = true
	fmt.Printf("processed          event %s  %s  %5d cents\n", eventID, account, cents)
}

// reportDuplicates sits just outside the dedup middleware: a message acked
// without its handler having run was a duplicate. (The library itself logs
// duplicates at Debug level and counts them in (*idem.Dedup).Stats.)
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

// poisonPublisher returns next, printing and counting what it publishes.
func (r *report) poisonPublisher(next message.Publisher) message.Publisher {
	return poisonPublisher{r: r, next: next}
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

// createTopic creates topic through the Kafka admin API (on the in-process
// broker as on a real cluster). An existing topic is not an error.
func createTopic(brokers []string, topic string, partitions int32) error {
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
	if errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return nil
	}
	return err
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
