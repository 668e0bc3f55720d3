package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/relaystep"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// While rows keep coming, one forwarder transaction goes on from cut to
// cut: a row committed after a cut was read is read with the position
// update past that cut, while the cut is being sent, and both go out in
// order under one COMMIT. The forwarder as it was before (one cut per
// transaction, relaystep.WithSerial) needs a transaction for each.
func TestForwarder_NextCutInTheSameTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	e.kafka(t) // one broker for both
	for _, c := range []struct {
		name    string
		serial  bool
		commits uint64
	}{{"pipelined", false, 1}, {"serial", true, 2}} {
		t.Run(c.name, func(t *testing.T) {
			topic := e.topic(t, "nextcut-"+c.name, 1)
			e.publishTx(t, topic, event("k", 0))
			f, err := outbox.NewForwarder(outbox.ForwarderConfig{
				DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}, PollInterval: 10 * time.Millisecond,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			var cuts atomic.Int32
			paused, release := make(chan struct{}), make(chan struct{})
			outbox.SetHook(f, func(s string) {
				if s == "cut" && cuts.Add(1) == 1 {
					close(paused)
					<-release
				}
			})
			ctx := context.Background()
			if c.serial {
				ctx = relaystep.WithSerial(ctx)
			}
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			defer func() {
				require.NoError(t, f.Close())
				require.NoError(t, <-done)
			}()

			<-paused // the first cut (k/0) is read
			e.publishTx(t, topic, event("k", 1))
			close(release)

			require.Eventually(t, func() bool { return f.Stats().Forwarded == 2 }, eventuallyTimeout, 5*time.Millisecond)
			require.Equal(t, []string{"k/0", "k/1"}, seqs(t, consume(t, e.broker.Addrs, topic, 2)))
			require.EqualValues(t, 2, highWater(t, e.broker.Addrs, topic))
			require.Equal(t, c.commits, f.Stats().Commits, "transactions that forwarded the two cuts")
		})
	}
}
