package idemtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/internal/kfake"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// defaultDatabaseURL is what [Schema] connects to when DATABASE_URL is unset.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// Kafka returns the addresses of a Kafka-protocol broker that lives until the
// test ends: the cluster named by KAFKA_BROKERS (comma separated) when it is
// set, otherwise an in-process broker on a random 127.0.0.1 port, which real
// clients (Sarama through watermill-kafka, franz-go) reach over TCP. The
// in-process broker is franz-go's kfake with the library's patches to its
// consumer-group coordinator (so a group rebalances as Kafka's does); it
// creates a topic of one partition when a client first names it.
func Kafka(tb testing.TB) []string {
	tb.Helper()
	brokers, stop, err := StartKafka()
	if err != nil {
		tb.Fatalf("idemtest: start a Kafka-protocol broker: %v", err)
	}
	tb.Cleanup(stop)
	return brokers
}

// StartKafka is [Kafka] for programs (an example, a local demo): it returns
// the brokers of KAFKA_BROKERS, or starts the in-process broker, and a stop
// function that closes it (a no-op for KAFKA_BROKERS).
func StartKafka() (brokers []string, stop func(), err error) {
	if brokers := kafkatest.External(); brokers != nil {
		return brokers, func() {}, nil
	}
	c, err := kafkatest.NewFake(kfake.AllowAutoTopicCreation())
	if err != nil {
		return nil, nil, err
	}
	return c.ListenAddrs(), c.Close, nil
}

// Schema creates a throwaway PostgreSQL schema named after the test (plus a
// random suffix) in the database of DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test), and returns a pool whose
// search_path is that schema, with the schema's name (for
// deduplicator.TableConfig.Schema and outbox tables). When the test ends
// the schema is dropped and the pool closed. The pool's size is pgxpool's
// default unless DATABASE_URL sets pool_max_conns.
func Schema(tb testing.TB) (pool *pgxpool.Pool, schema string) {
	tb.Helper()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = defaultDatabaseURL
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("idemtest: DATABASE_URL: %v", err)
	}
	schema = schemaName(tb.Name())
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	ctx := context.Background()
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		tb.Fatalf("idemtest: %v", err)
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		tb.Fatalf("idemtest: create schema %s on %s (is PostgreSQL running? set DATABASE_URL): %v", schema, cfg.ConnConfig.Host, err)
	}
	tb.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			tb.Errorf("idemtest: drop schema %s: %v", schema, err)
		}
		pool.Close()
	})
	return pool, schema
}

// schemaName is "t_" + the test's name in lower case, letters and digits
// only, cut to fit PostgreSQL's 63-byte identifiers with a random suffix.
func schemaName(test string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(test) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else if r == '_' || r == '/' || r == ' ' || r == '-' {
			b.WriteByte('_')
		}
	}
	name := b.String()
	if len(name) > 40 {
		name = name[:40]
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	return "t_" + name + "_" + hex.EncodeToString(rnd[:])
}
