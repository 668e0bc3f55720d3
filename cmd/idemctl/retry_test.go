package main_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type parkedJSON struct {
	Groups []struct {
		ConsumerGroup    string  `json:"consumer_group"`
		Keys             int64   `json:"keys"`
		Events           int64   `json:"events"`
		MaxQueue         int64   `json:"max_queue"`
		OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	} `json:"groups"`
	Keys []struct {
		Key                string  `json:"key"`
		Events             int64   `json:"events"`
		Head               string  `json:"head"`
		HeadTopic          string  `json:"head_topic"`
		HeadOverdueSeconds float64 `json:"head_overdue_seconds"`
	} `json:"keys"`
}

// retry parked shows a parked key (its queue, its first event, how overdue
// its copy is); retry unblock sends that event again through the outbox,
// then --skip removes it and hands the key to the next event.
func TestRetryParkedAndUnblock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain", "orders.retry")
	require.NoError(t, migrate.Up(ctx, db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema})))
	require.Contains(t, ok(t, db, "retry", "parked").Stdout, "no parked key")

	head, next := publisher.NewEventID(), publisher.NewEventID()
	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata)
VALUES ('billing', 'acct-42', $1::uuid, 'orders.retry', now() - interval '2 hours', 'm0', '{}', jsonb_build_object('event_id', $1::text, 'retry_attempt', '3'))`, head.String())
	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, message_uuid, payload, metadata)
VALUES ('billing', 'acct-42', $1::uuid, 'm1', '{}', jsonb_build_object('event_id', $1::text, 'retry_attempt', '0'))`, next.String())

	r := ok(t, db, "retry", "parked")
	require.Regexp(t, `billing\s+1\s+2\s+2\s+`, r.Stdout)
	require.Regexp(t, `billing\s+acct-42\s+2\s+`+head.String()+`\s+orders.retry\s+(1h59m|2h)`, r.Stdout)
	p := decode[parkedJSON](t, ok(t, db, "retry", "parked", "--json", "--group", "billing"))
	require.Len(t, p.Groups, 1)
	require.EqualValues(t, 2, p.Groups[0].MaxQueue)
	require.Len(t, p.Keys, 1)
	require.Equal(t, head.String(), p.Keys[0].Head)
	require.Greater(t, p.Keys[0].HeadOverdueSeconds, 3600.0)

	fails(t, db, 2, "--yes", "retry", "unblock", "--group", "billing", "--key", "acct-42")
	fails(t, db, 2, "key not parked", "retry", "unblock", "--group", "billing", "--key", "acct-7", "--yes")
	r = ok(t, db, "retry", "unblock", "--group", "billing", "--key", "acct-42", "--yes")
	require.Contains(t, r.Stdout, "event "+head.String()+" sent to orders.retry again")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1 AND metadata->>'retry_attempt' = '3'`, head.String()))

	r = ok(t, db, "retry", "unblock", "--group", "billing", "--key", "acct-42", "--skip", "--yes")
	require.Contains(t, r.Stdout, "the key is handed to event "+next.String())
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1`, next.String()))
	p = decode[parkedJSON](t, ok(t, db, "retry", "parked", "--json"))
	require.Len(t, p.Keys, 1)
	require.Equal(t, next.String(), p.Keys[0].Head)
	require.Equal(t, "orders.retry", p.Keys[0].HeadTopic)
}

// retry unblock --overdue is the recovery of a stalled retry path
// (retrytopic.ErrHeadOverdue): it sends again the first event of every key
// whose copy is overdue by more than the given time, and leaves the others.
func TestRetryUnblockOverdue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain", "orders.retry")
	require.NoError(t, migrate.Up(ctx, db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema})))
	stalled1, stalled2, recent := publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID()
	for _, r := range []struct {
		key, ago string
		id       string
	}{{"acct-1", "1 hour", stalled1.String()}, {"acct-2", "20 minutes", stalled2.String()}, {"acct-3", "30 seconds", recent.String()}} {
		db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata)
VALUES ('billing', $1, $2::uuid, 'orders.retry', now() - $3::interval, 'm', '{}', jsonb_build_object('event_id', $2::text, 'retry_attempt', '1'))`, r.key, r.id, r.ago)
	}

	fails(t, db, 2, "one of --key or --overdue", "retry", "unblock", "--group", "billing", "--yes")
	fails(t, db, 2, "one of --key or --overdue", "retry", "unblock", "--group", "billing", "--key", "acct-1", "--overdue", "5m", "--yes")
	fails(t, db, 2, "--skip", "retry", "unblock", "--group", "billing", "--overdue", "5m", "--skip", "--yes")
	r := ok(t, db, "retry", "unblock", "--group", "billing", "--overdue", "5m", "--yes")
	require.Contains(t, r.Stdout, "2 keys unblocked")
	for _, id := range []string{stalled1.String(), stalled2.String()} {
		require.Equal(t, 1, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1`, id), id)
	}
	require.Zero(t, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1`, recent.String()))
}
