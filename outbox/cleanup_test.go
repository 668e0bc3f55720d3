package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

func TestDeleteForwarded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "cleanup", 1)
	table := e.outbox.MessagesTable(topic)
	for i := 0; i < 10; i++ {
		msgs := make([]*message.Message, 0, 30)
		for j := 0; j < 30; j++ {
			msgs = append(msgs, event("a", i*30+j))
		}
		e.publishTx(t, topic, msgs...)
	}

	// No position yet: nothing is deleted.
	n, err := e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.Zero(t, n)

	// A position in the middle of a transaction's rows: exactly the rows at
	// or before it go.
	e.db.Exec(t, `INSERT INTO `+outbox.OffsetsTable(e.outbox, topic)+` (consumer_group, offset_acked, last_processed_transaction_id)
		SELECT 'manual', "offset", transaction_id FROM `+table+` ORDER BY transaction_id, "offset" OFFSET 99 LIMIT 1`)
	n, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Forwarders: []string{"manual"}, Topics: []string{topic}})
	require.NoError(t, err)
	require.EqualValues(t, 100, n)
	require.Equal(t, 200, e.db.Count(t, `SELECT 1 FROM `+table))

	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, BatchSize: 50, Name: "fast"})
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 200 }, eventuallyTimeout, 5*time.Millisecond)

	// A second reader (a watermill-sql subscriber group) that has not read
	// anything keeps every row, and so does one without a position.
	e.db.Exec(t, `INSERT INTO `+outbox.OffsetsTable(e.outbox, topic)+` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('slow', 0, '0')`)
	n, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Forwarders: []string{"fast", "slow"}, Topics: []string{topic}})
	require.NoError(t, err)
	require.Zero(t, n)
	n, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Forwarders: []string{"fast", "missing", "fast"}, Topics: []string{topic}})
	require.NoError(t, err)
	require.Zero(t, n)

	// Once "fast" alone counts, everything it passed goes, in batches.
	n, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Forwarders: []string{"fast", "fast"}, Topics: []string{topic}, BatchSize: 70})
	require.NoError(t, err)
	require.EqualValues(t, 200, n)
	require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+table))

	// New rows are forwarded after the cleanup: the position is unaffected.
	e.publishTx(t, topic, event("a", 300))
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 201 }, eventuallyTimeout, 5*time.Millisecond)
	require.EqualValues(t, 201, highWater(t, e.kafka(t).Addrs, topic))
	n, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Forwarders: []string{"fast"}, Topics: []string{topic}})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	_, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}, BatchSize: -1})
	require.ErrorContains(t, err, "BatchSize")
	_, err = e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Topics: []string{"bad topic; DROP"}})
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)
}
