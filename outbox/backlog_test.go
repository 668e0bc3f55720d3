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

	b, err := e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.Equal(t, []outbox.Backlog{{Topic: topic, Forwarder: outbox.DefaultForwarderName}}, b)

	msgs := make([]*message.Message, 0, 25)
	for i := 0; i < 25; i++ {
		msgs = append(msgs, event("a", i))
	}
	e.publishTx(t, topic, msgs...)
	e.db.Exec(t, `UPDATE `+e.outbox.MessagesTable(topic)+` SET created_at = (now() AT TIME ZONE 'UTC') - interval '1 hour' WHERE "offset" = (SELECT min("offset") FROM `+e.outbox.MessagesTable(topic)+`)`)

	// No forwarder position yet: every committed row is pending.
	b, err = e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
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
	b, err = e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.Equal(t, []outbox.Backlog{{Topic: topic, Forwarder: outbox.DefaultForwarderName}}, b)

	// A forwarder of another name that never ran sees everything as pending.
	b, err = e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Forwarder: "other", Topics: []string{topic}})
	require.NoError(t, err)
	require.EqualValues(t, 25, b[0].Pending)

	_, err = e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{"bad topic; DROP"}})
	require.ErrorIs(t, err, outbox.ErrInvalidTopic)
}

// With nil options, Backlog and DeleteForwarded cover the Outbox's
// Config.Topics and the position of the forwarder named
// DefaultForwarderName.
func TestBacklogAndDeleteForwarded_Defaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "defaults", 1)
	ob, err := outbox.New(outbox.Config{Schema: e.db.Schema, Topics: []string{topic}}, nil)
	require.NoError(t, err)
	e.publishTx(t, topic, event("a", 0), event("a", 1))

	b, err := ob.Backlog(ctx, e.db.Pool, nil)
	require.NoError(t, err)
	require.Len(t, b, 1)
	require.Equal(t, topic, b[0].Topic)
	require.EqualValues(t, 2, b[0].Pending)
	n, err := ob.DeleteForwarded(ctx, e.db.Pool, nil)
	require.NoError(t, err)
	require.Zero(t, n, "no forwarder position yet")

	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 2 }, eventuallyTimeout, 5*time.Millisecond)
	b, err = ob.Backlog(ctx, e.db.Pool, nil)
	require.NoError(t, err)
	require.Equal(t, []outbox.Backlog{{Topic: topic, Forwarder: outbox.DefaultForwarderName}}, b)
	n, err = ob.DeleteForwarded(ctx, e.db.Pool, nil)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.Zero(t, e.db.Count(t, `SELECT 1 FROM `+ob.MessagesTable(topic)))
}

// Writers and readers in different time zones agree on a row's age: rows
// get created_at in UTC and Backlog compares with UTC. Before, the
// writer's zone (here UTC+9) against the reader's (UTC-8, and -7 in
// summer) gave an age 16 or 17 hours off, clamped to 0.
func TestBacklog_OldestAgeAcrossTimeZones(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0)
	topic := e.topic(t, "backlog-tz", 1)
	writer := e.pool(t, map[string]string{"timezone": "Asia/Tokyo"}, nil)
	reader := e.pool(t, map[string]string{"timezone": "America/Los_Angeles"}, nil)

	require.NoError(t, e.outbox.PoolPublisher(writer).Publish(topic, event("a", 0)))
	b, err := e.outbox.Backlog(ctx, reader, &outbox.BacklogOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.Len(t, b, 1)
	require.EqualValues(t, 1, b[0].Pending)
	require.Positive(t, b[0].OldestAge, "a pending row has waited some time")
	require.Less(t, b[0].OldestAge, time.Hour, "not hours off")
}
