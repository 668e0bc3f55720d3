package idemtest_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func setupOutbox(t *testing.T, db *pgtest.DB, topics ...string) *outbox.Outbox {
	t.Helper()
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: topics}, nil)
	require.NoError(t, err)
	var lines []migrate.Line
	for _, topic := range topics {
		lines = append(lines, outbox.MigrationLine(ob.Config(), topic))
	}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, lines...))
	return ob
}

// A handler that publishes its follow-up event through the outbox, run under
// redelivery (with a rolled-back first run): exactly one outbox message,
// caused by the incoming event.
func TestRequireOutboxMessageUnderRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _, dedup := setup(t, "billing")
	ob := setupOutbox(t, db, "invoices")
	handler := func(msg *message.Message) ([]*message.Message, error) {
		pub, err := ob.PublisherFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		out := message.NewMessage(uuid.NewString(), []byte(`{"invoice":1}`))
		out.SetContext(msg.Context())
		out.Metadata.Set("kind", "invoice")
		return nil, pub.Publish("invoices", out)
	}
	id := publisher.NewEventID()
	idemtest.RunWithRedelivery(ctx, t, dedup, handler, newMsg(id), &idemtest.RedeliveryOpts{Deliveries: 4, RollbackFirst: true})

	got := idemtest.RequireOutboxMessage(ctx, t, db.Pool, ob, "invoices", &idemtest.RequireOutboxOpts{CausationID: id, Metadata: map[string]string{"kind": "invoice"}, Count: 1})
	require.JSONEq(t, `{"invoice":1}`, string(got[0].Payload))
	_, err := publisher.ParseEventID(got[0].Metadata.Get(publisher.MetadataEventID))
	require.NoError(t, err, "the outbox stamps a UUIDv7 event id")
	idemtest.RequireOutboxMessage(ctx, t, db.Pool, ob, "invoices", nil)
	idemtest.RequireNoOutboxMessage(ctx, t, db.Pool, ob, "invoices", &idemtest.RequireOutboxOpts{CausationID: publisher.NewEventID()})
}

func TestRequireOutboxMessageFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	ob := setupOutbox(t, db, "invoices")

	msg := expectFatal(t, func(tb testing.TB) { idemtest.RequireOutboxMessage(ctx, tb, db.Pool, ob, "invoices", nil) })
	require.Contains(t, msg, "no outbox message")
	msg = expectFatal(t, func(tb testing.TB) { idemtest.RequireOutboxMessage(ctx, tb, db.Pool, ob, "missing", nil) })
	require.Contains(t, msg, "no table for topic")
	msg = expectFatal(t, func(tb testing.TB) { idemtest.RequireOutboxMessage(ctx, tb, db.Pool, ob, `x"; DROP TABLE y`, nil) })
	require.Contains(t, msg, "invalid topic")

	// Uncommitted writes are visible through the writing transaction only.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	id := publisher.NewEventID()
	m := message.NewMessage(uuid.NewString(), []byte(`{}`))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	require.NoError(t, ob.PublishInTx(ctx, tx, "invoices", m, m.Copy()))
	idemtest.RequireOutboxMessage(ctx, t, tx, ob, "invoices", &idemtest.RequireOutboxOpts{EventID: id, Count: 2})
	idemtest.RequireNoOutboxMessage(ctx, t, db.Pool, ob, "invoices", nil)
	msg = expectFatal(t, func(tb testing.TB) {
		idemtest.RequireOutboxMessage(ctx, tb, tx, ob, "invoices", &idemtest.RequireOutboxOpts{EventID: id, Count: 1})
	})
	require.Contains(t, msg, "want 1")
	msg = expectFatal(t, func(tb testing.TB) { idemtest.RequireNoOutboxMessage(ctx, tb, tx, ob, "invoices", nil) })
	require.Contains(t, msg, "want none")
}
