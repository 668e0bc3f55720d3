package main_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
)

// A position moved a million transaction ids ahead of the cluster (what a
// restore leaves): backlog and prune refuse it and say how to recover;
// reposition --dry-run lists what would be re-sent and changes nothing;
// reposition resets it, and every row is pending again, none deleted.
func TestOutboxReposition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain", "orders")
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	pub := ob.PoolPublisher(db.Pool)
	require.NoError(t, pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("1")), message.NewMessage(watermill.NewUUID(), []byte("2"))))
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Publisher: gochannel.NewGoChannel(gochannel.Config{}, nil), PollInterval: 10 * time.Millisecond}, nil)
	require.NoError(t, err)
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fwd.Run(fctx) }()
	require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 2 }, time.Minute, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	const ahead = `(pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000)::text`
	db.Exec(t, `UPDATE outbox_orders__offsets SET position_snapshot = (`+ahead+` || ':' || `+ahead+` || ':')::pg_snapshot, position_xmax = `+ahead+`::xid8`)
	require.NoError(t, pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("3"))))

	fails(t, db, 1, "position of outbox_forwarder in topic orders is from another cluster", "outbox", "backlog")
	fails(t, db, 1, "idemctl outbox reposition --dry-run", "outbox", "prune")
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM outbox_orders"), "nothing deleted")

	r := ok(t, db, "outbox", "reposition", "--dry-run")
	require.Regexp(t, `orders\s+another cluster's\s+3\s+1-3\s+0`, r.Stdout)
	require.Contains(t, r.Stdout, "orders: outbox: position of outbox_forwarder in topic orders is from another cluster")
	require.Contains(t, r.Stdout, "dry run, nothing changed: 3 rows would be forwarded again by outbox_forwarder")
	fails(t, db, 1, "from another cluster", "outbox", "backlog")
	j := decode[struct {
		Forwarder string `json:"forwarder"`
		DryRun    bool   `json:"dry_run"`
		Topics    []struct {
			Topic   string `json:"topic"`
			Problem string `json:"problem"`
			Resend  int64  `json:"resend"`
			Done    bool   `json:"done"`
		} `json:"topics"`
	}](t, ok(t, db, "outbox", "reposition", "--dry-run", "--json"))
	require.True(t, j.DryRun)
	require.Equal(t, "orders", j.Topics[0].Topic)
	require.EqualValues(t, 3, j.Topics[0].Resend)
	require.Contains(t, j.Topics[0].Problem, "ahead of this cluster's")
	require.False(t, j.Topics[0].Done)

	r = ok(t, db, "outbox", "reposition")
	require.Contains(t, r.Stdout, "positions of outbox_forwarder reset: 3 rows (every row in the tables) will be forwarded again; nothing was deleted")
	b := decode[backlogJSON](t, ok(t, db, "outbox", "backlog", "--json"))
	require.EqualValues(t, 3, b.Topics[0].Pending)
	r = ok(t, db, "outbox", "reposition", "--dry-run")
	require.Regexp(t, `orders\s+this cluster's\s+3\s+1-3\s+0`, r.Stdout)
	require.Contains(t, ok(t, db, "outbox", "prune").Stdout, "0 rows deleted")
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM outbox_orders"))
}
