package middleware_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Names a configuration might carry, none of which is a plain identifier.
var securityBadIdents = []string{
	`x; DROP TABLE canary`,
	`canary"; DROP TABLE canary; --`,
	`"quoted"`,
	`a.b`,
	`a b`,
	`a-b`,
	`1starts_with_digit`,
	"nul\x00byte",
	"new\nline",
	`événement`, // unicode letters
	`ｐｒｏｃｅｓｓｅｄ`, // fullwidth
	`processed_event$`,
	strings.Repeat("a", 64), // over NAMEDATALEN-1: the server would truncate it silently
}

// securitySnapshot lists the schema's relations and the schemas named like
// one of the refused identifiers (other tests create and drop their own
// schemas in parallel, so a server-wide count would not be attributable).
func securitySnapshot(t *testing.T, db *pgtest.DB) string {
	t.Helper()
	var rels, schemas string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT coalesce(string_agg(relname, ',' ORDER BY relname), '') FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1`, db.Schema).Scan(&rels))
	names := make([]string, 0, len(securityBadIdents))
	for _, n := range securityBadIdents {
		if !strings.ContainsRune(n, 0) { // a text parameter cannot carry NUL
			names = append(names, n, n[:min(len(n), 63)])
		}
	}
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(*)::text FROM pg_namespace WHERE nspname::text = ANY($1::text[])`, names).Scan(&schemas))
	return rels + " / schemas named like a refused identifier:" + schemas
}

// Schema and table names from configuration are validated before any SQL is
// built: injection strings, quotes, dots, unicode and over-long names are
// refused by every constructor and by Migrate, and nothing changes in the
// database (the canary table survives, no relation or schema appears).
func TestSecurityIdentifiersRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	db.Exec(t, `CREATE TABLE canary (id int)`)
	before := securitySnapshot(t, db)

	for _, name := range securityBadIdents {
		for _, tc := range []struct {
			field string
			table deduplicator.TableConfig
		}{
			{"Schema", deduplicator.TableConfig{Schema: name}},
			{"Table", deduplicator.TableConfig{Schema: db.Schema, Table: name}},
		} {
			label := fmt.Sprintf("%s=%q", tc.field, name)
			_, err := deduplicator.New(deduplicator.Config{TableConfig: tc.table, ConsumerGroup: "g"}, nil)
			require.ErrorContains(t, err, tc.field, "deduplicator.New %s", label)
			_, err = migrate.New(nil, deduplicator.MigrationLine(tc.table))
			require.ErrorContains(t, err, tc.field, "deduplicator.MigrationLine %s", label)
			err = migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(tc.table))
			require.ErrorContains(t, err, tc.field, "migrate.Up %s", label)
			_, err = idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: tc.table}, nil)
			require.ErrorContains(t, err, tc.field, "idem.NewDedup %s", label)
		}
		_, err := outbox.New(outbox.Config{Schema: name}, nil)
		require.ErrorContains(t, err, "Schema", "outbox.New Schema=%q", name)
		_, err = outbox.New(outbox.Config{Schema: db.Schema, TablePrefix: name}, nil)
		require.ErrorContains(t, err, "TablePrefix", "outbox.New TablePrefix=%q", name)
	}

	// Topics become table names too: only [A-Za-z0-9-$:._] and the length limit.
	for _, topic := range []string{`x"; DROP TABLE canary; --`, `a b`, "nul\x00", `événement`, `t'q`, strings.Repeat("t", 60)} {
		_, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{topic}}, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidTopic, "outbox.New Topics=%q", topic)
		ob, err := outbox.New(outbox.Config{Schema: db.Schema}, nil)
		require.NoError(t, err)
		err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
			return ob.PublishInTx(ctx, tx, topic, msg)
		})
		require.ErrorIs(t, err, outbox.ErrInvalidTopic, "PublishInTx topic=%q", topic)
	}

	require.Equal(t, before, securitySnapshot(t, db), "refused names must not change the database")
	require.Equal(t, 0, db.Count(t, `SELECT 1 FROM canary`))
}

// Names that are valid but need quoting (reserved words, upper case, the
// 63-byte limit, a dotted topic) work and create exactly the named relation.
func TestSecurityIdentifiersQuoted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	long := strings.Repeat("p", 55) // 63 bytes with its companion table's suffix (_setting)
	for _, table := range []string{"select", "user", "Processed_Event", long} {
		cfg := deduplicator.TableConfig{Schema: db.Schema, Table: table}
		require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(cfg)), table)
		require.Equal(t, 1, db.Count(t, `SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, db.Schema, table), "table %q exists with its exact name", table)
		d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: cfg}, nil)
		require.NoError(t, err)
		id := publisher.NewEventID()
		msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
		msg.Metadata.Set(publisher.MetadataEventID, id.String())
		_, err = d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg)
		require.NoError(t, err)
		require.Equal(t, 1, db.Count(t, `SELECT 1 FROM `+pgx.Identifier{db.Schema, table}.Sanitize()+` WHERE event_id = $1`, id))
	}

	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders.v1"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "orders.v1")))
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox_orders.v1'`, db.Schema),
		"a dotted topic is one quoted table name, not schema.table")
}

// The Kafka config helpers override only delivery-safety settings: TLS, SASL,
// ClientID and the version of the caller's base config pass through, and the
// base config itself is not modified.
func TestSecurityKafkaTLSAndSASLPassThrough(t *testing.T) {
	t.Parallel()
	tlsCfg := &tls.Config{ServerName: "kafka.internal.example", MinVersion: tls.VersionTLS12}
	base := sarama.NewConfig()
	base.ClientID = "billing-service"
	base.Version = sarama.V3_6_0_0
	base.Net.TLS.Enable = true
	base.Net.TLS.Config = tlsCfg
	base.Net.SASL.Enable = true
	base.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
	base.Net.SASL.User = "svc-billing"
	base.Net.SASL.Password = "s3cret"
	base.Net.SASL.Handshake = true
	base.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return nil }
	base.Net.SASL.AuthIdentity = "authz"
	baseCopy := *base

	check := func(t *testing.T, c *sarama.Config) {
		t.Helper()
		require.NotSame(t, base, c, "the helper must copy the base config")
		require.True(t, c.Net.TLS.Enable)
		require.Same(t, tlsCfg, c.Net.TLS.Config)
		require.True(t, c.Net.SASL.Enable)
		require.Equal(t, sarama.SASLMechanism(sarama.SASLTypeSCRAMSHA512), c.Net.SASL.Mechanism)
		require.Equal(t, "svc-billing", c.Net.SASL.User)
		require.Equal(t, "s3cret", c.Net.SASL.Password)
		require.Equal(t, "authz", c.Net.SASL.AuthIdentity)
		require.True(t, c.Net.SASL.Handshake)
		require.NotNil(t, c.Net.SASL.SCRAMClientGeneratorFunc)
		require.Equal(t, "billing-service", c.ClientID)
		require.Equal(t, sarama.V3_6_0_0, c.Version)
		require.NoError(t, c.Validate())
	}

	sub, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"kafka:9093"}, Sarama: base}, "billing")
	require.NoError(t, err)
	check(t, sub.OverwriteSaramaConfig)
	require.Equal(t, sarama.OffsetOldest, sub.OverwriteSaramaConfig.Consumer.Offsets.Initial)

	pub, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: []string{"kafka:9093"}, Sarama: base})
	require.NoError(t, err)
	check(t, pub.OverwriteSaramaConfig)
	require.True(t, pub.OverwriteSaramaConfig.Producer.Idempotent)
	require.Equal(t, sarama.WaitForAll, pub.OverwriteSaramaConfig.Producer.RequiredAcks)

	check(t, idemkafka.SaramaProducerConfig(base))
	check(t, idemkafka.SaramaConsumerConfig(base))

	require.False(t, base.Producer.Idempotent, "the base config must not be modified")
	require.Equal(t, baseCopy.Consumer.Offsets.Initial, base.Consumer.Offsets.Initial)
	require.Equal(t, baseCopy.Net.MaxOpenRequests, base.Net.MaxOpenRequests)
}

// securityLogEntry is one captured log line.
type securityLogEntry struct {
	level string
	text  string
}

// securityLogger captures every log line with its level.
type securityLogger struct {
	mu      *sync.Mutex
	entries *[]securityLogEntry
	fields  watermill.LogFields
}

func newSecurityLogger() securityLogger {
	return securityLogger{mu: &sync.Mutex{}, entries: &[]securityLogEntry{}}
}

func (l securityLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	text := msg
	if err != nil {
		text += " err=" + err.Error()
	}
	text += fmt.Sprintf(" %v %v", l.fields, fields)
	*l.entries = append(*l.entries, securityLogEntry{level, text})
}

func (l securityLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("ERROR", msg, err, fields)
}
func (l securityLogger) Info(msg string, fields watermill.LogFields) { l.add("INFO", msg, nil, fields) }
func (l securityLogger) Debug(msg string, fields watermill.LogFields) {
	l.add("DEBUG", msg, nil, fields)
}
func (l securityLogger) Trace(msg string, fields watermill.LogFields) {
	l.add("TRACE", msg, nil, fields)
}
func (l securityLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return securityLogger{mu: l.mu, entries: l.entries, fields: l.fields.Add(fields)}
}

func (l securityLogger) snapshot() []securityLogEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]securityLogEntry(nil), *l.entries...)
}

// Payloads are never logged above Debug: a router (GoChannel, poison queue,
// retry, dedup middleware, outbox for returned messages) with a capturing
// logger goes through the refusal, handler-error, duplicate and success
// paths with payloads holding a secret; no Info or Error line contains it.
func TestSecurityPayloadNotLoggedAboveDebug(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db := pgtest.New(t, 8)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"out"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "out")))

	const secret = "SECRET-CARD-4111111111111111"
	logger := newSecurityLogger()
	ob, err = outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"out"}}, logger)
	require.NoError(t, err)
	dedup, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "g", Table: table, Outbox: ob}, logger)
	require.NoError(t, err)

	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	poisonMW, err := wmiddleware.PoisonQueueWithFilter(pubsub, "poison", idem.IsPermanent)
	require.NoError(t, err)
	router.AddMiddleware(poisonMW, wmiddleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, Logger: logger,
		ShouldRetry: func(p wmiddleware.RetryParams) bool { return !idem.IsPermanent(p.Err) }}.Middleware, dedup.Middleware)

	failing := map[string]bool{}
	var mu sync.Mutex
	done := make(chan string, 100)
	router.AddHandler("h", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
		defer func() { done <- msg.UUID }()
		mu.Lock()
		fail := failing[msg.UUID]
		mu.Unlock()
		if fail {
			return nil, errors.New("downstream unavailable")
		}
		out := message.NewMessage(uuid.NewString(), []byte(`{"echo":"`+secret+`"}`))
		return []*message.Message{out}, nil
	})
	poisoned, err := pubsub.Subscribe(ctx, "poison")
	require.NoError(t, err)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })

	body := []byte(`{"card":"` + secret + `","amount":1}`)
	mk := func(id string) *message.Message {
		m := message.NewMessage(uuid.NewString(), body)
		if id != "" {
			m.Metadata.Set(publisher.MetadataEventID, id)
		}
		return m
	}
	good := mk(publisher.NewEventID().String())
	failingMsg := mk(publisher.NewEventID().String())
	mu.Lock()
	failing[failingMsg.UUID] = true
	mu.Unlock()
	refused := []*message.Message{
		mk(""),                // missing: the JSON fallback parses the payload
		mk("not-a-uuid"),      // invalid
		mk(uuid.NewString()),  // v4
		mk(uuid.Nil.String()), // nil
		message.NewMessage(uuid.NewString(), []byte(secret+" not json")), // non-JSON payload, no header
	}
	all := append([]*message.Message{good, good.Copy(), failingMsg}, refused...)
	for _, m := range all {
		require.NoError(t, pubsub.Publish("in", m))
	}

	// Refused messages reach the poison topic; the failing one is not
	// permanent: Retry runs it again, then it is nacked and redelivered.
	for range refused {
		select {
		case m := <-poisoned:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("timeout waiting for poisoned messages")
		}
	}
	seen := map[string]int{}
	require.Eventually(t, func() bool {
		for {
			select {
			case id := <-done:
				seen[id]++
			default:
				return seen[good.UUID] >= 1 && seen[failingMsg.UUID] >= 2
			}
		}
	}, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, router.Close())

	entries := logger.snapshot()
	var errorsLogged int
	for _, e := range entries {
		if e.level == "ERROR" {
			errorsLogged++
		}
		if e.level == "ERROR" || e.level == "INFO" {
			require.NotContains(t, e.text, secret, "payload bytes in a %s log line: %s", e.level, e.text)
			require.NotContains(t, e.text, "amount", "payload bytes in a %s log line: %s", e.level, e.text)
		}
	}
	if testing.Verbose() {
		for _, e := range entries {
			if e.level == "ERROR" {
				t.Log(e.text)
			}
		}
	}
	require.Positive(t, errorsLogged, "the refusal and error paths must have logged (else this test checks nothing)")
}
