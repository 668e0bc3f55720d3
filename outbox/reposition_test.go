package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// aheadOfCluster is SQL for a transaction id a million ids ahead of the
// running cluster's, as text.
const aheadOfCluster = `(pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000)::text`

// A restore (or a move to a logically replicated copy) leaves a position
// from another transaction-id space, simulated by moving the stored
// position a million ids ahead of the cluster. A row committed afterwards,
// and a row whose transaction id is the other cluster's (restored with the
// table), would count as forwarded: the forwarder, Backlog and
// DeleteForwarded refuse with a *PositionError instead. Reposition (idemctl
// outbox reposition, dry run first) resets the position: every row still in the table reaches Kafka
// again, the unsent ones included, once, and nothing was deleted unsent.
func TestReposition_PositionAheadOfTheCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "restore", 1)
	const sent = 5
	for i := range sent {
		e.publishTx(t, topic, event("k", i))
	}
	forwardAll(t, e, topic, sent)
	offsets, messages := outbox.OffsetsTable(e.outbox, topic), e.outbox.MessagesTable(topic)

	e.db.Exec(t, `UPDATE `+offsets+` SET position_snapshot = (`+aheadOfCluster+` || ':' || `+aheadOfCluster+` || ':')::pg_snapshot,
		position_xmax = `+aheadOfCluster+`::xid8, cut_snapshot = NULL WHERE consumer_group = $1`, outbox.DefaultForwarderName)
	e.publishTx(t, topic, event("k", sent))   // committed after the restore
	e.publishTx(t, topic, event("k", sent+1)) // restored: its transaction id is the other cluster's
	e.db.Exec(t, `UPDATE `+messages+` SET transaction_id = (`+aheadOfCluster+`)::xid8 WHERE "offset" = (SELECT max("offset") FROM `+messages+`)`)
	const rows = sent + 2

	requireRefused(t, e, topic)

	dry := reposition(t, e, topic, true)
	require.False(t, dry.Done)
	require.EqualValues(t, rows, dry.Resend)
	require.EqualValues(t, 1, dry.Restamped)
	require.NotNil(t, dry.Foreign)
	require.False(t, dry.Foreign.OtherSystem(), "ahead of this cluster's ids, same system")
	requireRefused(t, e, topic) // a dry run changes nothing

	done := reposition(t, e, topic, false)
	require.True(t, done.Done)
	require.EqualValues(t, rows, done.Resend)
	require.EqualValues(t, 1, done.Restamped)
	bl, err := e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.EqualValues(t, rows, bl[0].Pending)

	forwardAll(t, e, topic, rows)
	recs := consume(t, e.broker.Addrs, topic, sent+rows)
	require.Len(t, recs, sent+rows)
	require.EqualValues(t, sent+rows, highWater(t, e.broker.Addrs, topic))
	requirePerKeyOrder(t, recs[:sent], sent)
	requirePerKeyOrder(t, recs[sent:], rows) // the second pass: every row, once, in order
	n, err := e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.EqualValues(t, rows, n, "every row was forwarded before it was deleted")
}

// A position written on another cluster (simulated: the system identifier
// stored with it is not this cluster's) stops a running forwarder with a
// *PositionError; Backlog and DeleteForwarded refuse it; Reposition resets
// it and a new forwarder forwards every row again.
func TestReposition_PositionFromAnotherSystem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 4)
	topic := e.topic(t, "othersystem", 1)
	const sent = 3
	for i := range sent {
		e.publishTx(t, topic, event("k", i))
	}
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}, PollInterval: 10 * time.Millisecond}, watermill.NopLogger{})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer f.Close()
	require.Eventually(t, func() bool { return f.Stats().Forwarded == sent }, eventuallyTimeout, 5*time.Millisecond)

	e.db.Exec(t, `UPDATE `+outbox.OffsetsTable(e.outbox, topic)+` SET position_system_identifier = (SELECT system_identifier FROM pg_control_system()) # 1 WHERE consumer_group = $1`, outbox.DefaultForwarderName)
	var runErr error
	select {
	case runErr = <-done:
	case <-time.After(eventuallyTimeout):
		t.Fatal("the running forwarder went on with a position of another cluster")
	}
	var pe *outbox.PositionError
	require.ErrorAs(t, runErr, &pe)
	require.NotEqual(t, pe.SystemID, pe.StoredSystemID)
	require.Contains(t, runErr.Error(), "written on another PostgreSQL cluster")
	e.publishTx(t, topic, event("k", sent))
	requireRefused(t, e, topic)

	r := reposition(t, e, topic, false)
	require.EqualValues(t, sent+1, r.Resend)
	require.Zero(t, r.Restamped)
	require.NotNil(t, r.Foreign)
	require.True(t, r.Foreign.OtherSystem())
	forwardAll(t, e, topic, sent+1)
	require.EqualValues(t, 2*sent+1, highWater(t, e.broker.Addrs, topic))
}

// reposition resets the default forwarder's position in topic as idemctl
// outbox reposition does (with dryRun, only reports), in one transaction.
func reposition(t *testing.T, e *env, topic string, dryRun bool) outboxsql.Repositioned {
	t.Helper()
	ctx := context.Background()
	cfg := e.outbox.Config()
	var r outboxsql.Repositioned
	require.NoError(t, pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) (err error) {
		r, err = outboxsql.TopicTables(cfg.Schema, cfg.TablePrefix, topic).Reposition(ctx, tx, outbox.DefaultForwarderName, dryRun)
		return err
	}))
	return r
}

// requireRefused requires the forwarder, Backlog and DeleteForwarded to
// refuse topic's position with a *PositionError, and nothing to be deleted.
func requireRefused(t *testing.T, e *env, topic string) {
	t.Helper()
	ctx := context.Background()
	before := e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topic))
	onTopic := highWater(t, e.broker.Addrs, topic)

	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}}, watermill.NopLogger{})
	require.NoError(t, err)
	err = f.Run(ctx)
	var pe *outbox.PositionError
	require.ErrorAs(t, err, &pe, "the forwarder refuses")
	require.Equal(t, topic, pe.Topic)
	require.Equal(t, outbox.DefaultForwarderName, pe.Forwarder)
	require.Contains(t, err.Error(), "idemctl outbox reposition")

	_, err = e.outbox.Backlog(ctx, e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	require.ErrorAs(t, err, &pe, "Backlog refuses")

	n, err := e.outbox.DeleteForwarded(ctx, e.db.Pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}})
	require.ErrorAs(t, err, &pe, "DeleteForwarded refuses")
	require.Zero(t, n)
	require.Equal(t, before, e.db.Count(t, `SELECT 1 FROM `+e.outbox.MessagesTable(topic)), "nothing deleted")
	require.Equal(t, onTopic, highWater(t, e.broker.Addrs, topic), "nothing forwarded")
	require.False(t, errors.Is(err, context.Canceled))
}

// forwardAll runs a forwarder of topic until it forwarded n rows and the
// backlog is empty, then stops it.
func forwardAll(t *testing.T, e *env, topic string, n int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: e.db.Pool, Outbox: e.outbox, Producer: e.producer(t), Topics: []string{topic}, PollInterval: 10 * time.Millisecond}, watermill.NopLogger{})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	require.Eventually(t, func() bool { return f.Stats().Forwarded >= uint64(n) }, eventuallyTimeout, 5*time.Millisecond)
	waitPolls(t, f, 2)
	cancel()
	require.NoError(t, <-done)
	require.EqualValues(t, n, f.Stats().Forwarded)
	bl, err := e.outbox.Backlog(context.Background(), e.db.Pool, &outbox.BacklogOpts{Topics: []string{topic}})
	require.NoError(t, err)
	require.Zero(t, bl[0].Pending)
}
