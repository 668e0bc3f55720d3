package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

// An operator deletes the forwarder's position row to force a re-forward:
// the running forwarder notices without a new write, recreates the row at
// the start of the table (as at its first registration), logs that once,
// and forwards every row still in the table again; it does not loop on an
// error.
func TestForwarder_DeletedPositionIsRecreatedAndReforwards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "deleted", 1)
	const n = 10
	for i := range n {
		e.publishTx(t, topic, event("k", i))
	}
	logs := watermill.NewCaptureLogger()
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}, PollInterval: 10 * time.Millisecond}, logs)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() {
		require.NoError(t, f.Close())
		require.NoError(t, <-done)
	}()
	require.Eventually(t, func() bool { return f.Stats().Forwarded == n }, eventuallyTimeout, 5*time.Millisecond)
	waitPolls(t, f, 2)

	e.db.Exec(t, `DELETE FROM `+outbox.OffsetsTable(e.outbox, topic)+` WHERE consumer_group = $1`, outbox.DefaultForwarderName)
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 2*n }, eventuallyTimeout, 5*time.Millisecond)
	e.publishTx(t, topic, event("k", n))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 2*n+1 }, eventuallyTimeout, 5*time.Millisecond)
	waitPolls(t, f, 2)

	require.EqualValues(t, 2*n+1, highWater(t, e.broker.Addrs, topic), "every row again, once, then the new one")
	require.Zero(t, f.Stats().Errors, "no failed transaction")
	require.Equal(t, 1, e.db.Count(t, `SELECT 1 FROM `+outbox.OffsetsTable(e.outbox, topic)))
	var recreated int
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.Contains(m.Msg, "position was missing") {
			recreated++
			require.Equal(t, topic, m.Fields["topic"])
		}
	}
	require.Equal(t, 1, recreated, "logged once")
	require.Empty(t, logs.Captured()[watermill.ErrorLogLevel])
}
