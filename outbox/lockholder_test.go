package outbox_test

import (
	"context"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/netfault"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// pool opens a pool on e's schema with params as the sessions' settings
// and, when dial is not nil, connections dialled by it.
func (e *env) pool(t *testing.T, params map[string]string, dial func(context.Context, string, string) (net.Conn, error)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(e.db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 2
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if dial != nil {
		cfg.ConnConfig.DialFunc = dial
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// A forwarder whose host vanishes while it holds the topic's position lock
// (its connection goes silent, no TCP reset) does not stop the topic for
// the hours the kernel would take to notice: its transaction sets
// idle_in_transaction_session_timeout from SendTimeout, the server ends
// it, and the other instance, which waits with lock_timeout and logs the
// holder, forwards every row within a minute.
func TestForwarder_VanishedHolderReleasesThePositionLock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	topic := e.topic(t, "vanish", 1)
	const rows = 20
	e.publishTx(t, topic, events(rows, 4)...)

	// A: behind a connection that is cut once A holds the lock. Its
	// SendTimeout (8 s: released after 13 s) is longer than B's lock wait
	// (10 s), so B logs the holder once before it gets the lock.
	bh := netfault.NewBlackhole()
	poolA := e.pool(t, map[string]string{"application_name": "forwarder-a"}, bh.Dial)
	a, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: poolA, Outbox: e.outbox, Producer: e.producer(t),
		Topics: []string{topic}, PollInterval: 10 * time.Millisecond, SendTimeout: 8 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	locked := make(chan struct{})
	var once atomic.Bool
	outbox.SetHook(a, func(step string) {
		if step == "locked" && once.CompareAndSwap(false, true) {
			bh.Cut()
			close(locked)
		}
	})
	ctxA, cancelA := context.WithCancel(context.Background())
	doneA := make(chan error, 1)
	go func() { doneA <- a.Run(ctxA) }()
	// A never returns while its connection hangs: release it first.
	t.Cleanup(func() {
		bh.Release()
		cancelA()
		<-doneA
	})
	<-locked

	logs := watermill.NewCaptureLogger()
	start := time.Now()
	b := e.startForwarderLogged(t, outbox.ForwarderConfig{Topics: []string{topic}}, logs)

	require.Eventually(t, func() bool { return b.Stats().Forwarded == rows }, time.Minute, 20*time.Millisecond,
		"the other instance forwards within a minute of the holder's host vanishing")
	t.Logf("forwarded by B %s after A vanished", time.Since(start).Round(time.Millisecond))
	requirePerKeyOrder(t, consume(t, e.broker.Addrs, topic, rows), rows/4)
	require.Zero(t, b.Stats().Errors, "a lock wait is not a failure")

	var holder *watermill.CapturedMessage
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.Contains(m.Msg, "locked by another forwarder") {
			holder = &m
			break
		}
	}
	require.NotNil(t, holder, "B logged who held the lock")
	require.Equal(t, "forwarder-a", holder.Fields["holder_application"])
	require.Equal(t, "idle in transaction", holder.Fields["holder_state"])
	require.NotZero(t, holder.Fields["holder_pid"])
}

// slowProducer takes d longer than the real producer for every send: a
// slow broker.
type slowProducer struct {
	sarama.SyncProducer
	d time.Duration
}

func (p slowProducer) SendMessages(msgs []*sarama.ProducerMessage) error {
	time.Sleep(p.d)
	return p.SyncProducer.SendMessages(msgs)
}

// A database-wide (here: session) idle_in_transaction_session_timeout
// shorter than a send is explained at start-up, and does not end the
// forwarder's transactions: they set their own from SendTimeout. Without
// that, every transaction would die during its send, and its pages would
// be sent again, forever.
func TestForwarder_ServerIdleTimeoutShorterThanASend(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	topic := e.topic(t, "idle", 1)
	const rows = 30
	e.publishTx(t, topic, events(rows, 3)...)

	pool := e.pool(t, map[string]string{"idle_in_transaction_session_timeout": "200ms"}, nil)
	logs := watermill.NewCaptureLogger()
	f := e.startForwarderLogged(t, outbox.ForwarderConfig{DB: pool,
		Producer: slowProducer{SyncProducer: e.producer(t), d: 600 * time.Millisecond},
		Topics:   []string{topic}, BatchSize: 10, SendTimeout: 5 * time.Second}, logs)

	require.Eventually(t, func() bool { return f.Stats().Forwarded == rows }, eventuallyTimeout, 20*time.Millisecond)
	require.Zero(t, f.Stats().Errors, "no transaction ended during its send")
	require.EqualValues(t, rows, highWater(t, e.broker.Addrs, topic), "nothing sent twice")

	var explained bool
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		explained = explained || strings.Contains(m.Msg, "idle_in_transaction_session_timeout (200ms) is shorter than a send")
	}
	require.True(t, explained, "the start-up log explains the database's timeout")
}
