package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

func TestBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "backlog", 1)

	b, err := e.outbox.Backlog(ctx, e.db.Pool, "", topic)
	require.NoError(t, err)
	require.Equal(t, []outbox.Backlog{{Topic: topic}}, b)

	msgs := make([]*message.Message, 0, 25)
	for i := 0; i < 25; i++ {
		msgs = append(msgs, event("a", i))
	}
	e.publishTx(t, topic, msgs...)
	e.db.Exec(t, `UPDATE `+e.outbox.MessagesTable(topic)+` SET created_at = LOCALTIMESTAMP - interval '1 hour' WHERE "offset" = (SELECT min("offset") FROM `+e.outbox.MessagesTable(topic)+`)`)

	// No forwarder position yet: every committed row is pending.
	b, err = e.outbox.Backlog(ctx, e.db.Pool, "", topic)
	require.NoError(t, err)
	require.Len(t, b, 1)
	require.EqualValues(t, 25, b[0].Pending)
	require.GreaterOrEqual(t, b[0].OldestAge, time.Hour)

	// An uncommitted transaction's rows are not visible, hence not pending.
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	require.NoError(t, e.outbox.Publisher(tx).Publish(topic, event("a", 99)))

	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 25 }, eventuallyTimeout, 5*time.Millisecond)
	b, err = e.outbox.Backlog(ctx, e.db.Pool, "", topic)
	require.NoError(t, err)
	require.Equal(t, []outbox.Backlog{{Topic: topic}}, b)

	// Another group that never ran sees everything as pending.
	b, err = e.outbox.Backlog(ctx, e.db.Pool, "other", topic)
	require.NoError(t, err)
	require.EqualValues(t, 25, b[0].Pending)

	_, err = e.outbox.Backlog(ctx, e.db.Pool, "", "bad topic; DROP")
	require.Error(t, err)
}
