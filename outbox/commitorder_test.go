package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// seqs returns the aggregate/seq of every record, in Kafka order.
func seqs(t *testing.T, recs []record) []string {
	t.Helper()
	out := make([]string, len(recs))
	for i, r := range recs {
		p := decode(t, r.Value)
		out[i] = fmt.Sprintf("%s/%d", p.Aggregate, p.Seq)
	}
	return out
}

// waitLockWait waits until backend pid waits for a lock.
func waitLockWait(t *testing.T, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting bool
		err := pool.QueryRow(context.Background(), `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting)
		return err == nil && waiting
	}, eventuallyTimeout, time.Millisecond)
}

// The case. B writes something unrelated first, so it holds the
// lower transaction id; then it waits for the aggregate's row lock, which A
// holds while it publishes "A" and commits; then B publishes "B" and
// commits. Kafka has A before B: commit order, whether the two commits fall
// in one cut of the forwarder (started after both) or in two (running all
// along).
func TestForwarder_LowerIDCommitsLater_CommitOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 8)
	e.db.Exec(t, `CREATE TABLE aggregate (id text PRIMARY KEY, version int NOT NULL)`)
	e.db.Exec(t, `CREATE TABLE audit (note text)`)
	e.db.Exec(t, `INSERT INTO aggregate VALUES ('k', 0)`)

	for _, running := range []bool{true, false} {
		topic := e.topic(t, "commitorder", 1)
		var f *outbox.Forwarder
		if running {
			f = e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
		}
		txB, err := e.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer txB.Rollback(ctx)
		var xidB string
		var pidB uint32
		require.NoError(t, txB.QueryRow(ctx, `INSERT INTO audit VALUES ('B was here first') RETURNING pg_current_xact_id()::text, pg_backend_pid()`).Scan(&xidB, &pidB))

		txA, err := e.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer txA.Rollback(ctx)
		var version int
		require.NoError(t, txA.QueryRow(ctx, `SELECT version FROM aggregate WHERE id = 'k' FOR UPDATE`).Scan(&version))
		var lower bool
		require.NoError(t, txA.QueryRow(ctx, `SELECT $1::xid8 < pg_current_xact_id()`, xidB).Scan(&lower))
		require.True(t, lower, "B holds the lower transaction id")
		_, err = txA.Exec(ctx, `UPDATE aggregate SET version = version + 1 WHERE id = 'k'`)
		require.NoError(t, err)
		require.NoError(t, e.outbox.Publisher(txA).Publish(topic, event("k", version)))

		bDone := make(chan error, 1)
		go func() {
			bDone <- func() error {
				var v int
				if err := txB.QueryRow(ctx, `SELECT version FROM aggregate WHERE id = 'k' FOR UPDATE`).Scan(&v); err != nil {
					return err
				}
				if _, err := txB.Exec(ctx, `UPDATE aggregate SET version = version + 1 WHERE id = 'k'`); err != nil {
					return err
				}
				if err := e.outbox.Publisher(txB).Publish(topic, event("k", v)); err != nil {
					return err
				}
				return txB.Commit(ctx)
			}()
		}()
		waitLockWait(t, e.db.Pool, pidB)
		require.NoError(t, txA.Commit(ctx))
		require.NoError(t, <-bDone)

		if !running {
			f = e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
		}
		recs := consume(t, e.broker.Addrs, topic, 2)
		require.Equal(t, []string{fmt.Sprintf("k/%d", version), fmt.Sprintf("k/%d", version+1)}, seqs(t, recs), "forwarder running: %v", running)
		require.Zero(t, f.Stats().Errors)
	}
}

// A transaction holding a transaction id in another database of the server
// does not hold the forwarder back: rows committed meanwhile are forwarded
// while it is still open.
func TestForwarder_ForeignTransactionDoesNotStall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "foreign", 2)

	name := "fdb_" + strings.TrimPrefix(e.db.Schema, "t_")
	name = name[:min(len(name), 63)]
	admin, err := pgx.Connect(ctx, e.db.URL)
	require.NoError(t, err)
	defer admin.Close(ctx)
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), e.db.URL)
		require.NoError(t, err)
		defer c.Close(context.Background())
		_, err = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})
	fcfg, err := pgx.ParseConfig(e.db.URL)
	require.NoError(t, err)
	fcfg.Database = name
	foreign, err := pgx.ConnectConfig(ctx, fcfg)
	require.NoError(t, err)
	defer foreign.Close(ctx)
	ftx, err := foreign.Begin(ctx)
	require.NoError(t, err)
	var xid string
	var pid uint32
	require.NoError(t, ftx.QueryRow(ctx, `SELECT pg_current_xact_id()::text, pg_backend_pid()`).Scan(&xid, &pid))

	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	const n = 20
	for i := 0; i < n; i++ {
		e.publishTx(t, topic, event(fmt.Sprintf("agg-%d", i%4), i/4))
	}
	require.Eventually(t, func() bool { return f.Stats().Forwarded == n }, eventuallyTimeout, 5*time.Millisecond,
		"rows committed while another database's transaction is open are forwarded")
	require.Len(t, consume(t, e.broker.Addrs, topic, n), n)

	var held string
	require.NoError(t, e.db.Pool.QueryRow(ctx, `SELECT coalesce(backend_xid::text, '') FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&held))
	require.Equal(t, xid, held, "the foreign transaction was open all along")
	require.NoError(t, ftx.Rollback(ctx))
}

// Many writers, random commit delays, random long transactions (some
// writing first and locking later, some holding a transaction id without
// writing the outbox), some rolled back, on shared keys serialized by a row
// lock; two forwarder replicas with small pages. Every committed row is
// forwarded once, and for every key Kafka's order is the commit order,
// recorded by the writers under the lock as the key's counter.
func TestForwarder_RaceCommitOrder(t *testing.T) {
	t.Parallel()
	const (
		writers   = 10
		perWriter = 30
		keys      = 6
	)
	ctx := context.Background()
	e := newEnv(t, 12) // writers wait for a connection now and then: more interleavings
	topic := e.topic(t, "race", 3)
	e.db.Exec(t, `CREATE TABLE counter (k text PRIMARY KEY, n int NOT NULL)`)
	e.db.Exec(t, `CREATE TABLE audit (note text)`)
	for k := 0; k < keys; k++ {
		e.db.Exec(t, `INSERT INTO counter VALUES ($1, 0)`, fmt.Sprintf("key-%d", k))
	}
	var fs []*outbox.Forwarder
	for i := 0; i < 2; i++ {
		fs = append(fs, e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, BatchSize: 7, BatchesPerTransaction: 2}))
	}

	stop := make(chan struct{})
	var holders sync.WaitGroup
	for h := 0; h < 2; h++ {
		holders.Add(1)
		go func() {
			defer holders.Done()
			rng := rand.New(rand.NewPCG(uint64(h), 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
						return err
					}
					time.Sleep(time.Duration(50+rng.IntN(200)) * time.Millisecond)
					return nil
				})
				require.NoError(t, err)
			}
		}()
	}

	var committed atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			sleep := func(max int) { time.Sleep(time.Duration(rng.IntN(max+1)) * time.Millisecond) }
			for i := 0; i < perWriter; i++ {
				key := fmt.Sprintf("key-%d", rng.IntN(keys))
				tx, err := e.db.Pool.Begin(ctx)
				require.NoError(t, err)
				if rng.IntN(2) == 0 { // write first: a lower transaction id than the lock's holder
					_, err = tx.Exec(ctx, `INSERT INTO audit VALUES ('early')`)
					require.NoError(t, err)
					sleep(3)
				}
				var seq int
				require.NoError(t, tx.QueryRow(ctx, `UPDATE counter SET n = n + 1 WHERE k = $1 RETURNING n - 1`, key).Scan(&seq))
				require.NoError(t, e.outbox.Publisher(tx).Publish(topic, event(key, seq)))
				switch r := rng.IntN(20); {
				case r == 0:
					sleep(150) // a long transaction
				case r == 1:
					require.NoError(t, tx.Rollback(ctx)) // the counter rolls back too
					continue
				default:
					sleep(3)
				}
				require.NoError(t, tx.Commit(ctx))
				committed.Add(1)
			}
		}()
	}
	wg.Wait()
	close(stop)
	holders.Wait()

	n := committed.Load()
	forwarded := func() (sum uint64) {
		for _, f := range fs {
			sum += f.Stats().Forwarded
		}
		return sum
	}
	require.Eventually(t, func() bool { return forwarded() >= uint64(n) }, eventuallyTimeout, 10*time.Millisecond)
	for _, f := range fs {
		waitPolls(t, f, 2)
	}
	require.EqualValues(t, n, forwarded(), "each row forwarded once")
	recs := consume(t, e.broker.Addrs, topic, int(n))
	require.Len(t, recs, int(n))
	next := map[string]int{}
	for _, r := range recs {
		p := decode(t, r.Value)
		require.Equal(t, next[p.Aggregate], p.Seq, "%s out of commit order at partition %d offset %d", p.Aggregate, r.Partition, r.Offset)
		next[p.Aggregate]++
	}
	for k := 0; k < keys; k++ {
		key := fmt.Sprintf("key-%d", k)
		require.Equal(t, e.db.Count(t, `SELECT generate_series(1, n) FROM counter WHERE k = $1`, key), next[key], key)
	}
}

// With Listen and the table's notify trigger enabled, the forwarder wakes
// up when a writing transaction commits: with a poll interval of an hour, a
// committed row is still forwarded, also after the LISTEN connection was
// cut (it reconnects).
func TestForwarder_WakesUpOnCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "wake", 1)
	e.db.Exec(t, "ALTER TABLE "+e.outbox.MessagesTable(topic)+" ENABLE TRIGGER idem_outbox_notify")
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, PollInterval: time.Hour, RetryInterval: 10 * time.Millisecond, Listen: true})

	e.publishTx(t, topic, event("a", 0))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 1 }, eventuallyTimeout, 5*time.Millisecond)

	var pid uint32
	require.Eventually(t, func() bool {
		err := e.db.Pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN "' || $1 || '"'`, outbox.Channel(e.outbox, topic)).Scan(&pid)
		return err == nil
	}, eventuallyTimeout, 5*time.Millisecond)
	var ok bool
	require.NoError(t, e.db.Pool.QueryRow(ctx, `SELECT pg_terminate_backend($1, 30000)`, pid).Scan(&ok))
	require.True(t, ok)

	e.publishTx(t, topic, event("a", 1))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 2 }, eventuallyTimeout, 5*time.Millisecond)
	require.Equal(t, []string{"a/0", "a/1"}, seqs(t, consume(t, e.broker.Addrs, topic, 2)))
}

// Run retries its start-up until the database lets it in, logging each
// failure: here the forwarder's role may not log in at first.
func TestForwarder_RunRetriesStartup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2)
	topic := e.topic(t, "startup", 1)
	role := "r_" + strings.TrimPrefix(e.db.Schema, "t_")
	role = role[:min(len(role), 63)]
	quoted := pgx.Identifier{role}.Sanitize()
	e.db.Exec(t, "CREATE ROLE "+quoted+" NOLOGIN")
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), e.db.URL)
		require.NoError(t, err)
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		_, err = c.Exec(context.Background(), "DROP OWNED BY "+quoted)
		require.NoError(t, err)
		_, err = c.Exec(context.Background(), "DROP ROLE "+quoted)
		require.NoError(t, err)
	})
	schema := pgx.Identifier{e.db.Schema}.Sanitize()
	e.db.Exec(t, "GRANT USAGE ON SCHEMA "+schema+" TO "+quoted)
	e.db.Exec(t, "GRANT ALL ON ALL TABLES IN SCHEMA "+schema+" TO "+quoted)

	cfg, err := pgxpool.ParseConfig(e.db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.User = role
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	logs := &startFailures{LoggerAdapter: watermill.NopLogger{}, n: new(atomic.Int64)}
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic},
		RetryInterval: 10 * time.Millisecond, PollInterval: 10 * time.Millisecond}, logs)
	require.NoError(t, err, "a database that refuses the connection is left to Run")
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() {
		require.NoError(t, f.Close())
		require.NoError(t, <-done)
	}()
	require.Eventually(t, func() bool { return logs.n.Load() >= 2 }, eventuallyTimeout, 5*time.Millisecond, "each failed attempt is logged")

	e.db.Exec(t, "ALTER ROLE "+quoted+" LOGIN")
	e.publishTx(t, topic, event("a", 0))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 1 }, eventuallyTimeout, 5*time.Millisecond)
}

// Tables and a position left by watermill-sql's forwarder (migration 1, the
// position a (transaction_id, offset) in the middle of a transaction's rows)
// upgrade in place: the forwarder sends exactly the rows after the
// position, none lost, none resent.
func TestForwarder_UpgradeFromTransactionIDPosition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.kafka(t).Topic(t, "upgrade", 1)
	cfg := e.outbox.Config()
	cfg.Topics = []string{topic}
	m, err := newMigrator(e.db.Pool, cfg)
	require.NoError(t, err)
	_, err = m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 1})
	require.NoError(t, err)

	e.publishTx(t, topic, event("a", 0), event("b", 0))
	e.publishTx(t, topic, event("a", 1), event("a", 2), event("b", 1))
	e.publishTx(t, topic, event("a", 3))
	// watermill-sql's forwarder sent the first transaction and the
	// first row of the second one.
	e.db.Exec(t, `INSERT INTO `+outbox.OffsetsTable(e.outbox, topic)+` (consumer_group, offset_acked, last_processed_transaction_id)
		SELECT $1, "offset", transaction_id FROM `+e.outbox.MessagesTable(topic)+` ORDER BY transaction_id, "offset" OFFSET 2 LIMIT 1`, outbox.DefaultForwarderName)

	res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Len(t, res.Versions, 4)
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 3 }, eventuallyTimeout, 5*time.Millisecond)
	e.publishTx(t, topic, event("b", 2))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 4 }, eventuallyTimeout, 5*time.Millisecond)
	require.Equal(t, []string{"a/2", "b/1", "a/3", "b/2"}, seqs(t, consume(t, e.broker.Addrs, topic, 4)))
	require.EqualValues(t, 4, highWater(t, e.broker.Addrs, topic), "nothing resent")
}

// startFailures counts the forwarder's "cannot start" error logs.
type startFailures struct {
	watermill.LoggerAdapter
	n *atomic.Int64
}

func (l *startFailures) Error(msg string, err error, fields watermill.LogFields) {
	if strings.Contains(msg, "cannot start") {
		l.n.Add(1)
	}
}

func (l *startFailures) With(watermill.LogFields) watermill.LoggerAdapter { return l }
