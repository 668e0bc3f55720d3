package main_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A forwarder moves a row over its limit, and the later row of its key, to
// the dead table; outbox dead list shows both, drop deletes the poison row
// and retry sends the held one.
func TestOutboxDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain", "orders")
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders"}}, nil)
	require.NoError(t, err)
	pub := ob.PoolPublisher(db.Pool)
	msg := func(key, payload string) *message.Message {
		return publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(payload)), key)
	}
	require.NoError(t, pub.Publish("orders", msg("k", strings.Repeat("x", 3000)), msg("k", "2"), msg("other", "3")))
	sink := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Publisher: sink, PollInterval: 10 * time.Millisecond, MaxMessageBytes: 2048}, nil)
	require.NoError(t, err)
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fwd.Run(fctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 1 && fwd.Stats().Quarantined == 2 }, time.Minute, 10*time.Millisecond)

	r := ok(t, db, "outbox", "dead", "list")
	requireRow(t, r.Stdout, `orders 1 1 "k"`)
	require.Contains(t, r.Stdout, "larger than the producer's limit")
	require.Contains(t, r.Stdout, "held behind dead row 1")
	require.Contains(t, r.Stdout, "2 dead rows")
	j := decode[struct {
		Rows []struct {
			ID         int64  `json:"id"`
			Key        string `json:"key"`
			HeldBehind int64  `json:"held_behind"`
			Size       int    `json:"size"`
		} `json:"rows"`
	}](t, ok(t, db, "outbox", "dead", "list", "--json"))
	require.Len(t, j.Rows, 2)
	require.Greater(t, j.Rows[0].Size, 2048)
	require.Equal(t, j.Rows[0].ID, j.Rows[1].HeldBehind)

	fails(t, db, 2, "pass --yes", "outbox", "dead", "drop", "--id", "1")
	fails(t, db, 2, "needs --key", "outbox", "dead", "retry", "--yes")
	fails(t, db, 1, "no dead row 99", "outbox", "dead", "drop", "--id", "99", "--yes")
	require.Contains(t, ok(t, db, "outbox", "dead", "drop", "--id", "1", "--yes").Stdout, "dead row 1 of orders deleted")
	require.Contains(t, ok(t, db, "outbox", "dead", "retry", "--key", "k", "--yes").Stdout, "1 rows of key \"k\" moved back")
	require.Eventually(t, func() bool { return fwd.Stats().Forwarded == 2 }, time.Minute, 10*time.Millisecond)
	require.Contains(t, ok(t, db, "outbox", "dead", "list").Stdout, "0 dead rows")
}
