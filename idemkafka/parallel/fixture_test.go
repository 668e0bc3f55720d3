package parallel_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// event is the payload of the ledger tests: the seq-th event of key.
type event struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

// fixture is a topic on the broker and a schema with processed_event and a
// ledger whose bigserial id records the order the events were applied in.
type fixture struct {
	broker *kafkatest.Broker
	topic  string
	db     *pgtest.DB
	table  deduplicator.TableConfig
	pub    *kafka.Publisher
	// outer are middlewares router adds first, outside the others.
	outer []message.HandlerMiddleware
}

func newFixture(t *testing.T, partitions int32, conns int32) *fixture {
	t.Helper()
	ctx := context.Background()
	f := &fixture{broker: kafkatest.Start(t), db: pgtest.New(t, conns)}
	f.topic = f.broker.Topic(t, "ledger", partitions)
	f.table = deduplicator.TableConfig{Schema: f.db.Schema}
	require.NoError(t, migrate.Up(ctx, f.db.Pool, deduplicator.MigrationLine(f.table)))
	f.db.Exec(t, "CREATE TABLE ledger (id bigserial PRIMARY KEY, key text NOT NULL, seq int NOT NULL, event_id uuid NOT NULL)")
	pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: f.broker.Addrs})
	require.NoError(t, err)
	f.pub, err = kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.pub.Close() })
	return f
}

// keyName is the i-th key.
func keyName(i int) string { return fmt.Sprintf("k%03d", i) }

// produce publishes perKey events for each of keys keys, interleaved, each
// with its key's sequence number.
func (f *fixture) produce(t *testing.T, keys, perKey int) {
	t.Helper()
	f.produceSeqs(t, keys, 1, perKey)
}

// produceSeqs publishes the events from..to (sequence numbers) of each of
// keys keys, interleaved.
func (f *fixture) produceSeqs(t *testing.T, keys, from, to int) {
	t.Helper()
	var msgs []*message.Message
	for seq := from; seq <= to; seq++ {
		for k := range keys {
			msgs = append(msgs, f.event(t, keyName(k), seq))
		}
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
}

func (f *fixture) event(t *testing.T, key string, seq int) *message.Message {
	t.Helper()
	b, err := json.Marshal(event{Key: key, Seq: seq})
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7()).String()
	m := message.NewMessage(id, b)
	m.Metadata.Set(publisher.MetadataEventID, id)
	m.Metadata.Set(publisher.MetadataPartitionKey, key)
	return m
}

// config is a subscriber config on the fixture's broker for group.
func (f *fixture) config(group string) parallel.SubscriberConfig {
	return parallel.SubscriberConfig{
		Client:          idemkafka.ClientConfig{Brokers: f.broker.Addrs, RevokeTimeout: 5 * time.Second},
		ConsumerGroup:   group,
		NackResendSleep: 10 * time.Millisecond,
	}
}

func (f *fixture) subscriber(t *testing.T, cfg parallel.SubscriberConfig) *parallel.Subscriber {
	t.Helper()
	sub, err := parallel.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	return sub
}

// ledgerHandler applies an event: one ledger row in the dedup transaction.
// fail, when set, makes an attempt fail before the write.
func ledgerHandler(fail func(event) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var ev event
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return nil, err
		}
		if fail != nil {
			if err := fail(ev); err != nil {
				return nil, err
			}
		}
		tx := idem.MustTxFromContext(msg.Context())
		id, _ := idem.EventIDFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger (key, seq, event_id) VALUES ($1, $2, $3)", ev.Key, ev.Seq, id)
		return nil, err
	}
}

// router runs h behind watermill's Retry (retries in-process retries) and
// the dedup middleware on sub, until the test ends or the returned stop is
// called.
func (f *fixture) router(t *testing.T, sub message.Subscriber, pool *pgxpool.Pool, retries int, mod func(*idem.Config), h message.HandlerFunc) (stop func()) {
	t.Helper()
	cfg := idem.Config{DB: pool, ConsumerGroup: "ledger", Table: f.table}
	if mod != nil {
		mod(&cfg)
	}
	d, err := idem.NewDedup(cfg, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(f.outer...)
	if retries > 0 {
		r.AddMiddleware(wmiddleware.Retry{MaxRetries: retries, InitialInterval: time.Millisecond}.Middleware)
	}
	r.AddMiddleware(d.Middleware)
	r.AddConsumerHandler("ledger", f.topic, sub, func(m *message.Message) error { _, err := h(m); return err })
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(context.Background())
	}()
	<-r.Running()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			require.NoError(t, r.Close())
			<-done
		})
	}
	t.Cleanup(stop)
	return stop
}

// waitFor polls cond until it holds, failing the test after three minutes (a deadline for a loaded machine, not an expected duration).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitApplied waits for n ledger rows.
func (f *fixture) waitApplied(t *testing.T, n int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d ledger rows", n), func() bool {
		return f.db.Count(t, "SELECT 1 FROM ledger") >= n
	})
}

// verifyLedger checks that each of keys keys has applied seq 1..perKey
// exactly once, in that order.
func (f *fixture) verifyLedger(t *testing.T, keys, perKey int) {
	t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), "SELECT key, seq FROM ledger ORDER BY id")
	require.NoError(t, err)
	defer rows.Close()
	applied := map[string][]int{}
	for rows.Next() {
		var key string
		var seq int
		require.NoError(t, rows.Scan(&key, &seq))
		applied[key] = append(applied[key], seq)
	}
	require.NoError(t, rows.Err())
	require.Len(t, applied, keys)
	for k := range keys {
		seqs := applied[keyName(k)]
		want := make([]int, perKey)
		for i := range want {
			want[i] = i + 1
		}
		require.Equal(t, want, seqs, "key %s: every event once, in order", keyName(k))
	}
}

func (f *fixture) admin(t *testing.T) sarama.ClusterAdmin {
	t.Helper()
	a, err := sarama.NewClusterAdmin(f.broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	return a
}

// verifyLedgerKeys checks that key k applied seq 1..want[k] once each, in order.
func (f *fixture) verifyLedgerKeys(t *testing.T, want map[string]int) {
	t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), "SELECT key, seq FROM ledger ORDER BY id")
	require.NoError(t, err)
	got := map[string][]int{}
	for rows.Next() {
		var key string
		var seq int
		require.NoError(t, rows.Scan(&key, &seq))
		got[key] = append(got[key], seq)
	}
	require.NoError(t, rows.Err())
	exp := map[string][]int{}
	for k, n := range want {
		for i := 1; i <= n; i++ {
			exp[k] = append(exp[k], i)
		}
	}
	require.Equal(t, exp, got)
}
