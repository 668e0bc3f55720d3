package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// tables returns topic's tables, for the dead-row statements idemctl runs.
func (e *env) tables(topic string) outboxsql.Tables {
	return outboxsql.TopicTables(e.outbox.Config().Schema, e.outbox.Config().TablePrefix, topic)
}

// rawInsert writes a row the way another writer could (watermill-sql
// directly, a script, an older release): around the outbox's own checks.
func (e *env) rawInsert(t *testing.T, topic, metadata string, payload []byte) {
	t.Helper()
	e.db.Exec(t, `INSERT INTO `+e.outbox.MessagesTable(topic)+` (uuid, payload, metadata, transaction_id)
		VALUES ($1, $2, $3::json, pg_current_xact_id())`, watermill.NewUUID(), payload, metadata)
}

// One poison row (a record over the producer's limit) and one unreadable
// row do not stall their topic: each moves to the dead table with its cause,
// its key's later rows wait there behind it, the other keys go on, nothing
// is sent twice, and the forwarder never fails a transaction. Retrying the
// key after the limit is raised, or dropping the poison row and retrying,
// sends the key's rows in their order.
func TestForwarder_PoisonRowsAreQuarantinedAndTheTopicGoesOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "poison", 1)
	const limit = 4096

	e.publishTx(t, topic, event("a", 1), event("b", 1))
	big := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(`{"pad":"`+strings.Repeat("x", 2*limit)+`"}`)), "b")
	e.publishTx(t, topic, big) // the outbox's own limit is 1 MiB: accepted
	e.publishTx(t, topic, event("b", 3), event("c", 1))
	e.rawInsert(t, topic, `{"partition_key":"d","_watermill_message_uuid":"x"}`, []byte(`{"seq":1}`))
	e.rawInsert(t, topic, `{"partition_key":7}`, []byte(`{"seq":1}`)) // metadata that is not strings: no key known
	e.publishTx(t, topic, event("d", 2), event("a", 2), event("c", 2))

	logs := watermill.NewCaptureLogger()
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t),
		Topics: []string{topic}, PollInterval: 10 * time.Millisecond, MaxMessageBytes: limit}, logs)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() {
		require.NoError(t, f.Close())
		require.NoError(t, <-done)
	}()

	sent := consume(t, e.broker.Addrs, topic, 5)
	var got []string
	for _, r := range sent {
		got = append(got, r.Key+":"+r.Value)
	}
	require.Equal(t, []string{
		`a:{"aggregate":"a","seq":1}`, `b:{"aggregate":"b","seq":1}`, `c:{"aggregate":"c","seq":1}`,
		`a:{"aggregate":"a","seq":2}`, `c:{"aggregate":"c","seq":2}`,
	}, got, "the other keys go on, in order; b after its poison row and d after its own wait")
	waitPolls(t, f, 3)
	require.EqualValues(t, 5, highWater(t, e.broker.Addrs, topic), "nothing sent twice")
	require.Zero(t, f.Stats().Errors, "no failed transaction, no resend loop")
	require.EqualValues(t, 5, f.Stats().Quarantined)

	dead, err := e.tables(topic).DeadRows(ctx, e.db.Pool, nil, 0)
	require.NoError(t, err)
	require.Len(t, dead, 5)
	require.Equal(t, "b", dead[0].Key)
	require.Contains(t, dead[0].Cause, "larger than the producer's limit")
	require.Greater(t, dead[0].Size, limit)
	require.Zero(t, dead[0].HeldBehind)
	require.Equal(t, "b", dead[1].Key)
	require.Equal(t, dead[0].ID, dead[1].HeldBehind)
	require.Contains(t, string(dead[1].Payload), `"seq":3`)
	require.Equal(t, "d", dead[2].Key)
	require.Contains(t, dead[2].Cause, "reserved key")
	require.Equal(t, "", dead[3].Key, "unreadable metadata: no key")
	require.Contains(t, dead[3].Cause, "metadata")
	require.Equal(t, "d", dead[4].Key)
	require.Equal(t, dead[2].ID, dead[4].HeldBehind)

	// The log names the topic, the row, the key, the size and the cause.
	var named bool
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		var re *outbox.RowError
		if errors.As(m.Err, &re) && re.Key == "b" {
			named = true
			require.Equal(t, topic, m.Fields["topic"])
			require.Greater(t, re.Size, limit)
			require.ErrorIs(t, m.Err, publisher.ErrMessageTooLarge)
			require.Contains(t, m.Err.Error(), fmt.Sprintf("row %d", dead[0].Offset))
		}
	}
	require.True(t, named, "one error line for the poison row of key b")

	// d: drop the poison row, retry the key: its held row goes out.
	ok, err := e.tables(topic).DropDead(ctx, e.db.Pool, dead[2].ID)
	require.NoError(t, err)
	require.True(t, ok)
	n, err := e.tables(topic).RetryDeadTx(ctx, e.db.Pool, "d")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	sent = consume(t, e.broker.Addrs, topic, 6)
	require.Equal(t, `{"aggregate":"d","seq":2}`, sent[5].Value)

	// b: retried as is, it is still too large: back to the dead table,
	// its held row behind it, nothing sent.
	n, err = e.tables(topic).RetryDeadTx(ctx, e.db.Pool, "b")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.Eventually(t, func() bool {
		d, err := e.tables(topic).DeadRows(ctx, e.db.Pool, nil, 0)
		return err == nil && len(d) == 3
	}, eventuallyTimeout, 10*time.Millisecond)
	waitPolls(t, f, 3)
	require.EqualValues(t, 6, highWater(t, e.broker.Addrs, topic))
	require.Zero(t, f.Stats().Errors)
}

// The outbox refuses, at write time, what the forwarder could never send:
// a record over Config.MaxMessageBytes, and metadata with the reserved UUID
// key. The error is a *RowError, permanent for the dedup middleware, and
// nothing of the call is written.
func TestPublishRefusesWhatCannotBeSent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	topic := e.topic(t, "refuse", 1)
	o, err := outbox.New(outbox.Config{Schema: e.outbox.Config().Schema, MaxMessageBytes: 2048}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	for name, msg := range map[string]*message.Message{
		"too large":    message.NewMessage(watermill.NewUUID(), make([]byte, 4096)),
		"reserved key": message.NewMessage(watermill.NewUUID(), []byte(`{}`)),
	} {
		if name == "reserved key" {
			msg.Metadata.Set("_watermill_message_uuid", "x")
		}
		tx, err := e.db.Pool.Begin(ctx)
		require.NoError(t, err)
		err = o.Publisher(tx).Publish(topic, event("k", 1), msg)
		var re *outbox.RowError
		require.ErrorAs(t, err, &re, name)
		require.Equal(t, topic, re.Topic)
		require.Equal(t, msg.UUID, re.UUID)
		require.True(t, idem.IsPermanent(err), "%s: %v", name, err)
		var written int
		require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM `+e.outbox.MessagesTable(topic)).Scan(&written))
		require.Zero(t, written, "%s: nothing of the call is written", name)
		require.NoError(t, tx.Rollback(ctx))
	}
}

// A key's rows written after its poison row, and not yet read by the
// forwarder, would be sent before the dead rows if the key were retried
// then: the retry (idemctl outbox dead retry) refuses (ErrKeyPending)
// until the forwarder has held them behind the poison row, and the retry
// then sends the key in order.
func TestRetryDeadWaitsForTheKeysUnreadRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "dead-pending", 1)
	const limit = 4096
	run := func(maxBytes int) (*outbox.Forwarder, func()) {
		f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t),
			Topics: []string{topic}, PollInterval: 10 * time.Millisecond, MaxMessageBytes: maxBytes}, watermill.NopLogger{})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		return f, func() { require.NoError(t, f.Close()); require.NoError(t, <-done) }
	}

	big := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(`{"aggregate":"b","seq":2,"pad":"`+strings.Repeat("x", 2*limit)+`"}`)), "b")
	e.publishTx(t, topic, event("b", 1), big)
	f, stop := run(limit)
	require.Eventually(t, func() bool { return f.Stats().Quarantined == 1 }, eventuallyTimeout, 10*time.Millisecond)
	stop()

	// b's next row, written while no forwarder runs: unread.
	e.publishTx(t, topic, event("b", 3))
	_, err := e.tables(topic).RetryDeadTx(ctx, e.db.Pool, "b")
	require.ErrorIs(t, err, outboxsql.ErrKeyPending)
	require.ErrorContains(t, err, `key "b" has 1 rows not yet forwarded by `+outbox.DefaultForwarderName)
	dead, err := e.tables(topic).DeadRows(ctx, e.db.Pool, nil, 0)
	require.NoError(t, err)
	require.Len(t, dead, 1, "nothing moved")

	// The forwarder holds the row behind the poison row; the retry then
	// moves both, in order, and a forwarder with a larger limit sends them.
	f, stop = run(limit)
	require.Eventually(t, func() bool { return f.Stats().Quarantined == 1 }, eventuallyTimeout, 10*time.Millisecond)
	stop()
	n, err := e.tables(topic).RetryDeadTx(ctx, e.db.Pool, "b")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	_, stop = run(64 * 1024)
	defer stop()
	var seqs []int
	for _, r := range consume(t, e.broker.Addrs, topic, 3) {
		seqs = append(seqs, decode(t, r.Value).Seq)
	}
	require.Equal(t, []int{1, 2, 3}, seqs, "b in order")
}
