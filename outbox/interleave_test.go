package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

// The forwarder is paused at each step of its transaction while a writer
// that holds the lower transaction id (it wrote before) takes the key's
// lock, publishes the key's next event and commits. Whatever the step, the
// row is forwarded (not skipped) and the key's events reach Kafka in commit
// order.
func TestForwarder_CommitAtEveryStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 8)
	e.db.Exec(t, `CREATE TABLE counter (k text PRIMARY KEY, n int NOT NULL)`)
	e.db.Exec(t, `CREATE TABLE audit (note text)`)
	e.kafka(t) // one broker for every step

	for _, step := range []string{"begin", "locked", "cut", "sent", "commit"} {
		t.Run(step, func(t *testing.T) {
			topic := e.topic(t, "step-"+step, 1)
			e.db.Exec(t, `INSERT INTO counter VALUES ($1, 0)`, topic)
			// The writer that will commit during the pause starts first and
			// writes, so it holds the lower transaction id.
			late, err := e.db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer late.Rollback(ctx)
			_, err = late.Exec(ctx, `INSERT INTO audit VALUES ('late writer')`)
			require.NoError(t, err)

			var armed atomic.Bool
			paused, release := make(chan struct{}), make(chan struct{})
			cfg := outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}, PollInterval: 10 * time.Millisecond}
			f, err := outbox.NewForwarder(cfg, watermill.NopLogger{})
			require.NoError(t, err)
			outbox.SetHook(f, func(s string) {
				if s == step && armed.CompareAndSwap(true, false) {
					paused <- struct{}{}
					<-release
				}
			})
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			defer func() {
				require.NoError(t, f.Close())
				require.NoError(t, <-done)
			}()

			// The first event, committed by a later transaction, gives the
			// forwarder a cut to work on; it stops at the step.
			armed.Store(true)
			tx, err := e.db.Pool.Begin(ctx)
			require.NoError(t, err)
			var seq int
			require.NoError(t, tx.QueryRow(ctx, `UPDATE counter SET n = n + 1 WHERE k = $1 RETURNING n - 1`, topic).Scan(&seq))
			require.NoError(t, e.outbox.Publisher(tx).Publish(topic, event("k", seq)))
			require.NoError(t, tx.Commit(ctx))
			<-paused

			// Meanwhile the lower-id writer publishes the key's next event
			// under the lock, and commits.
			require.NoError(t, late.QueryRow(ctx, `UPDATE counter SET n = n + 1 WHERE k = $1 RETURNING n - 1`, topic).Scan(&seq))
			require.NoError(t, e.outbox.Publisher(late).Publish(topic, event("k", seq)))
			require.NoError(t, late.Commit(ctx))
			close(release)

			require.Eventually(t, func() bool { return f.Stats().Forwarded == 2 }, eventuallyTimeout, 5*time.Millisecond)
			require.Equal(t, []string{"k/0", "k/1"}, seqs(t, consume(t, e.broker.Addrs, topic, 2)))
			require.EqualValues(t, 2, highWater(t, e.broker.Addrs, topic))
		})
	}
}

// A forwarder reads the first page of its next transaction ahead, while
// the last page of the current one is being sent. Another instance of the
// same Name takes the position over between the two transactions and
// forwards that page itself: the first one must notice that the position
// moved, drop what it read ahead and continue from the new position. Every
// row reaches Kafka exactly once, in order.
func TestForwarder_ReadAheadDroppedAfterTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	topic := e.topic(t, "ahead", 1)
	const n, page = 50, 10
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i%5), i/5)
	}
	e.publishTx(t, topic, msgs...) // one cut of five pages

	// start runs a forwarder that stops before its second transaction
	// until released.
	start := func() (f *outbox.Forwarder, paused, release chan struct{}) {
		paused, release = make(chan struct{}), make(chan struct{})
		f, err := outbox.NewForwarder(outbox.ForwarderConfig{
			DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic},
			BatchSize: page, BatchesPerTransaction: 1, PollInterval: 10 * time.Millisecond,
		}, watermill.NopLogger{})
		require.NoError(t, err)
		var begins atomic.Int32
		outbox.SetHook(f, func(s string) {
			if s == "begin" && begins.Add(1) == 2 {
				close(paused)
				<-release
			}
		})
		done := make(chan error, 1)
		go func() { done <- f.Run(context.Background()) }()
		t.Cleanup(func() {
			require.NoError(t, f.Close())
			require.NoError(t, <-done)
		})
		return f, paused, release
	}

	a, pausedA, releaseA := start()
	<-pausedA // a sent page 1 and holds page 2, read ahead
	require.EqualValues(t, page, a.Stats().Forwarded)
	b, pausedB, releaseB := start()
	<-pausedB // b sent page 2 and moved the position past it
	require.EqualValues(t, page, b.Stats().Forwarded)
	close(releaseA)
	require.Eventually(t, func() bool { return a.Stats().Forwarded+b.Stats().Forwarded >= n }, eventuallyTimeout, 5*time.Millisecond)
	close(releaseB)
	waitPolls(t, a, 2)
	waitPolls(t, b, 2)
	require.EqualValues(t, n, a.Stats().Forwarded+b.Stats().Forwarded, "no page sent twice")
	require.EqualValues(t, n, highWater(t, e.broker.Addrs, topic))
	requirePerKeyOrder(t, consume(t, e.broker.Addrs, topic, n), n/5)
}
