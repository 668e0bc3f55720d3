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

type backlogJSON struct {
	Forwarder string `json:"forwarder"`
	Topics    []struct {
		Topic            string  `json:"topic"`
		Pending          int64   `json:"pending"`
		OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	} `json:"topics"`
}

func TestOutboxBacklogAndPrune(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t, "plain", "orders", "payments")
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"orders", "payments"}}, nil)
	require.NoError(t, err)
	pub := ob.PoolPublisher(db.Pool)
	require.NoError(t, pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("1")), message.NewMessage(watermill.NewUUID(), []byte("2"))))

	// The topics are found in idem_schema_migration.
	r := ok(t, db, "outbox", "backlog")
	require.Regexp(t, `orders\s+2\s+\S+`, r.Stdout)
	require.Regexp(t, `payments\s+0\s+-`, r.Stdout)
	b := decode[backlogJSON](t, ok(t, db, "outbox", "backlog", "--json", "--topics", "orders"))
	require.Equal(t, outbox.DefaultForwarderName, b.Forwarder)
	require.Len(t, b.Topics, 1)
	require.EqualValues(t, 2, b.Topics[0].Pending)
	require.Positive(t, b.Topics[0].OldestAgeSeconds)

	// Nothing forwarded yet: prune keeps every row.
	r = ok(t, db, "outbox", "prune")
	require.Contains(t, r.Stdout, "0 rows deleted")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM outbox_orders"))

	// Forward them (to an in-memory publisher), then prune.
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: db.Pool, Outbox: ob, Publisher: gochannel.NewGoChannel(gochannel.Config{}, nil), PollInterval: 10 * time.Millisecond}, nil)
	require.NoError(t, err)
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fwd.Run(fctx) }()
	require.Eventually(t, func() bool {
		bl, err := ob.Backlog(ctx, db.Pool, nil)
		return err == nil && bl[0].Pending == 0
	}, time.Minute, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	b = decode[backlogJSON](t, ok(t, db, "outbox", "backlog", "--json"))
	require.Zero(t, b.Topics[0].Pending)
	// Another reader without a position keeps every row.
	r = ok(t, db, "outbox", "prune", "--forwarders", outbox.DefaultForwarderName+",audit")
	require.Contains(t, r.Stdout, "0 rows deleted: those every one of outbox_forwarder, audit had forwarded")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM outbox_orders"))
	p := decode[struct {
		Topics []struct {
			Topic   string `json:"topic"`
			Deleted int64  `json:"deleted"`
		} `json:"topics"`
		Deleted int64 `json:"deleted"`
	}](t, ok(t, db, "outbox", "prune", "--json"))
	require.EqualValues(t, 2, p.Deleted)
	require.Equal(t, "orders", p.Topics[0].Topic)
	require.EqualValues(t, 2, p.Topics[0].Deleted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM outbox_orders"))

	// Bad input.
	fails(t, db, 2, `unknown outbox topic "nosuch"`, "outbox", "backlog", "--topics", "orders,nosuch")
	fails(t, db, 2, "invalid topic", "outbox", "prune", "--topics", "bad;topic")
	fails(t, db, 2, "no outbox topic: none is recorded under prefix ob_", "outbox", "backlog", "--outbox-prefix", "ob_")
	fails(t, db, 2, "--batch-size must not be negative", "outbox", "prune", "--batch-size", "-5")
}

type groupJSON struct {
	Group                string  `json:"group"`
	FirstSeen            *string `json:"first_seen"`
	IdempotencyNamespace string  `json:"idempotency_namespace"`
	Young                bool    `json:"young"`
}

func TestGroupsAndRetention(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	id := v7At(time.Now())
	claim(t, db, "billing", true, id)
	claim(t, db, "shipping", true)

	r := ok(t, db, "groups", "list")
	require.Regexp(t, `billing\s+\d{4}-\d\d-\d\d \S+\s+billing\s+\S+ \S+\s+yes`, r.Stdout)
	gs := decode[[]groupJSON](t, ok(t, db, "groups", "list", "--json"))
	require.Len(t, gs, 2)
	require.Equal(t, "billing", gs[0].Group)
	require.True(t, gs[0].Young)

	r = ok(t, db, "groups", "rename", "billing", "billing-v2")
	require.Contains(t, r.Stdout, "renamed billing to billing-v2: 1 claims copied")
	require.Contains(t, r.Stdout, `namespace "billing"`)
	ok(t, db, "dedup", "check", id.String(), "--group", "billing-v2")
	fails(t, db, 2, "consumer group already exists", "groups", "rename", "billing", "shipping")
	fails(t, db, 2, "consumer group not registered", "groups", "rename", "nosuch", "other")
	fails(t, db, 2, "two different", "groups", "rename", "billing", "billing")

	fails(t, db, 2, "pass --yes", "groups", "forget", "billing")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM processed_event"), "refused: nothing deleted")
	fails(t, db, 2, `unknown consumer group "nosuch"`, "groups", "forget", "nosuch", "--yes")
	f := decode[struct {
		ClaimsDeleted int64 `json:"claims_deleted"`
	}](t, ok(t, db, "groups", "forget", "billing", "--yes", "--json"))
	require.EqualValues(t, 1, f.ClaimsDeleted)
	gs = decode[[]groupJSON](t, ok(t, db, "groups", "list", "--json"))
	require.Equal(t, []string{"billing-v2", "shipping"}, []string{gs[0].Group, gs[1].Group})
	require.Equal(t, "billing", gs[0].IdempotencyNamespace)

	// Retention: lengthening at once, shortening only with --yes.
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "keeps claims for 7d")
	r = ok(t, db, "retention", "set", "30d")
	require.Contains(t, r.Stdout, "retention 30d (was 7d)")
	fails(t, db, 2, "pass --yes", "retention", "set", "48h")
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "30d")
	rs := decode[struct {
		RetentionSeconds float64 `json:"retention_seconds"`
	}](t, ok(t, db, "retention", "set", "48h", "--yes", "--json"))
	require.EqualValues(t, 48*3600, rs.RetentionSeconds)
	require.Contains(t, ok(t, db, "retention", "show").Stdout, "2d")
	fails(t, db, 2, "not a duration", "retention", "set", "forever")
	fails(t, db, 2, "must be positive", "retention", "set", "--", "-1h")
}
