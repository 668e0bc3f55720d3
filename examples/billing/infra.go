// The demo's infrastructure: its PostgreSQL schema and pools, tracing, Kafka and the migrations.

package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// openPostgres creates a fresh schema, dropped at the end.
func (d *demo) openPostgres(ctx context.Context) error {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	runID := hex.EncodeToString(rnd[:])
	schema := "billing_demo_" + runID
	if err := createSchema(ctx, d.cfg.DatabaseURL, schema); err != nil {
		return err
	}
	d.onClose(func() error { return dropSchema(d.cfg.DatabaseURL, schema) })
	d.table = deduplicator.TableConfig{Schema: schema}
	// A pool per service that holds transactions, as in processes of their
	// own; application_name tells their sessions apart (the slowdown's
	// idle-in-transaction sampler reports by it). The main pool serves
	// notification (a transaction per partition in flight), the order
	// service (4 at once) and the demo's own queries; billing's lease mode
	// needs 2 × LeaseConfig.Concurrency + 1, whatever its charges in flight; the
	// forwarder one per topic.
	pools := []struct {
		p    **pgxpool.Pool
		app  string
		size int
	}{
		{&d.pool, schema, int(d.cfg.Partitions) + 5},
		{&d.billingPool, schema + "/" + serviceBilling, d.billingConns()},
		{&d.fwdPool, schema + "/" + serviceForwarder, 3},
	}
	for _, p := range pools {
		pool, err := openPool(ctx, d.cfg.DatabaseURL, schema, p.app, int32(p.size))
		if err != nil {
			return err
		}
		*p.p = pool
		d.onClose(func() error { pool.Close(); return nil })
	}
	d.progress("PostgreSQL: schema %s", schema)

	// Names: with a real cluster, topics and groups are per run too.
	if len(d.cfg.Brokers) > 0 {
		d.suffix = "." + runID
	}
	d.n = newNames(d.suffix)
	return nil
}

// openTracing gives each service an SDK TracerProvider of its own, named by
// its resource's service.name, all exporting synchronously to one in-memory
// exporter: the report prints one order's trace from it.
func (d *demo) openTracing() {
	d.spans = tracetest.NewInMemoryExporter()
	d.providers = map[string]*sdktrace.TracerProvider{}
	for _, name := range []string{serviceOrders, serviceBilling, serviceNotification, serviceForwarder} {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(d.spans),
			sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", name))))
		d.providers[name] = tp
		d.onClose(func() error { return tp.Shutdown(context.Background()) })
	}
}

// openKafka starts kfake (unless Brokers is set), creates the topics and
// opens the Kafka clients.
func (d *demo) openKafka() error {
	d.brokers = d.cfg.Brokers
	if len(d.brokers) == 0 {
		fake, err := kafkatest.NewFake()
		if err != nil {
			return fmt.Errorf("start kfake: %w", err)
		}
		d.onClose(func() error { fake.Close(); return nil })
		d.brokers = fake.ListenAddrs()
		d.progress("Kafka: in-process kfake broker on %s", d.brokers[0])
	} else {
		d.progress("Kafka: %v (topics and groups suffixed %q)", d.brokers, d.suffix)
	}
	for _, t := range []struct {
		name string
		p    int32
	}{{d.n.orders, d.cfg.Partitions}, {d.n.charged, 1}, {d.n.poison, 1}} {
		if err := kafkatest.CreateTopic(d.brokers, t.name, t.p); err != nil {
			return fmt.Errorf("create topic %s: %w", t.name, err)
		}
	}

	kcfg := idemkafka.ClientConfig{Brokers: d.brokers}
	pubCfg, err := idemkafka.WatermillPublisherConfig(kcfg)
	if err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(pubCfg, d.cfg.Logger)
	if err != nil {
		return fmt.Errorf("kafka publisher: %w", err)
	}
	d.kafkaPub = kafkaPub
	d.onClose(ignoreError(kafkaPub.Close))

	manual := sarama.NewConfig()
	manual.Producer.Partitioner = sarama.NewManualPartitioner
	partPub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: d.brokers, Marshaler: partitionMarshaler{}, OverwriteSaramaConfig: idemkafka.SaramaProducerConfig(manual),
	}, d.cfg.Logger)
	if err != nil {
		return fmt.Errorf("kafka publisher: %w", err)
	}
	d.partPub = partPub
	d.onClose(ignoreError(partPub.Close))

	if d.producer, err = idemkafka.NewSyncProducer(kcfg); err != nil {
		return fmt.Errorf("kafka producer: %w", err)
	}
	d.onClose(ignoreError(d.producer.Close))

	if d.kclient, err = sarama.NewClient(d.brokers, idemkafka.SaramaConsumerConfig(nil)); err != nil {
		return fmt.Errorf("kafka client: %w", err)
	}
	d.onClose(ignoreError(d.kclient.Close))
	return nil
}

// migrate creates the dedup table, the outbox tables and the business
// tables. Migrations run before NewDedup, which may verify the table.
func (d *demo) migrate(ctx context.Context) error {
	if err := migrate.Up(ctx, d.pool, deduplicator.MigrationLine(d.table)); err != nil {
		return fmt.Errorf("migrate processed_event: %w", err)
	}
	ob, err := outbox.New(outbox.Config{Schema: d.table.Schema, Topics: []string{d.n.orders, d.n.charged}}, d.cfg.Logger)
	if err != nil {
		return err
	}
	if err := migrate.Up(ctx, d.pool, outbox.MigrationLine(ob.Config(), d.n.orders), outbox.MigrationLine(ob.Config(), d.n.charged)); err != nil {
		return fmt.Errorf("migrate outbox: %w", err)
	}
	d.ob = ob
	if _, err := d.pool.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	return nil
}

// topicRecords returns the number of records on topic: the sum over its
// partitions of the newest minus the oldest offset.
func topicRecords(client sarama.Client, topic string) (int, error) {
	if err := client.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	n := int64(0)
	for _, p := range parts {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return 0, err
		}
		n += newest - oldest
	}
	return int(n), nil
}

func createSchema(ctx context.Context, url, schema string) error {
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL at %s: %w (set DATABASE_URL)", url, err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	return nil
}

// openPool opens a pool on schema whose sessions are named app
// (application_name). A claim's winner never needs a second connection,
// so claims waiting on it cannot starve it.
func openPool(ctx context.Context, url, schema, app string, maxConns int32) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pcfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, pcfg)
}

func dropSchema(url, schema string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("drop schema: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", schema, err)
	}
	return nil
}
