package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

// A graceful stop (a cancelled context, or Close) at any step of a
// multi-page transaction ends it cleanly: no panic, the pages already sent
// are committed, and a forwarder started afterwards sends only the rest.
// Every row reaches Kafka exactly once.
func TestForwarder_StopAtEveryStepOfAMultiPageTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	e.kafka(t)                // one broker for every case
	const rows, page = 50, 10 // five pages: four in the first transaction, one in the second

	type point struct {
		step string
		nth  int // the nth time the step is reached
	}
	points := []point{{"begin", 1}, {"locked", 1}, {"cut", 1}, {"acked", 1}, {"acked", 2}, {"sent", 1}, {"sent", 2}, {"acked", 4}, {"sent", 4}, {"commit", 1}, {"begin", 2}}
	for _, mode := range []string{"cancel", "close"} {
		for _, p := range points {
			t.Run(fmt.Sprintf("%s/%s-%d", mode, p.step, p.nth), func(t *testing.T) {
				topic := e.topic(t, "stop", 1)
				msgs := make([]*message.Message, rows)
				for i := range msgs {
					msgs[i] = event(fmt.Sprintf("agg-%d", i%5), i/5)
				}
				e.publishTx(t, topic, msgs...) // one cut of five pages

				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				f, err := outbox.NewForwarder(outbox.ForwarderConfig{
					DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic},
					BatchSize: page, BatchesPerTransaction: 4, PollInterval: 10 * time.Millisecond,
				}, watermill.NopLogger{})
				require.NoError(t, err)
				seen := map[string]int{}
				stopped := false
				outbox.SetHook(f, func(s string) {
					seen[s]++
					if stopped || s != p.step || seen[s] != p.nth {
						return
					}
					stopped = true
					if mode == "cancel" {
						cancel()
					} else {
						go func() { _ = f.Close() }()
					}
					// The stop is in effect before the step goes on.
					<-outbox.Stopping(f)
				})
				require.NoError(t, f.Run(ctx), "Run after a stop at %s #%d", p.step, p.nth)
				require.NoError(t, f.Close())
				require.True(t, stopped, "the forwarder reached %s #%d", p.step, p.nth)
				require.Zero(t, f.Stats().Errors)
				sent := highWater(t, e.broker.Addrs, topic)
				require.EqualValues(t, sent, f.Stats().Forwarded, "every record sent was committed")

				// A new forwarder sends the rest, nothing twice.
				g := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, BatchSize: page})
				require.Eventually(t, func() bool { return sent+int64(g.Stats().Forwarded) >= rows }, eventuallyTimeout, 5*time.Millisecond)
				waitPolls(t, g, 2)
				require.EqualValues(t, rows, highWater(t, e.broker.Addrs, topic), "records on the topic = rows")
				requirePerKeyOrder(t, consume(t, e.broker.Addrs, topic, rows), rows/5)
			})
		}
	}
}
