package failures_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/contract"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/auditsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type RefundIssued struct {
	EventID string `json:"eventId" validate:"required,uuid"`
	OrderID string `json:"orderId" validate:"required"`
	Amount  string `json:"amount" validate:"required,decimal=2"`
}

type fixture struct {
	db       *pgtest.DB
	kc       idemkafka.ClientConfig
	poison   string
	orders   string
	pub      message.Publisher
	explorer *failures.Explorer
	refunds  *contract.Contract[RefundIssued]
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(ctx, db.Pool, failures.MigrationLines(db.Schema)...))
	broker := kafkatest.Start(t)
	f := &fixture{db: db, kc: idemkafka.ClientConfig{Brokers: broker.Addrs}}
	f.poison = broker.Topic(t, "refunds-poison", 1)
	f.orders = broker.Topic(t, "refunds", 1)
	pc, err := idemkafka.WatermillPublisherConfig(f.kc)
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	f.pub = pub
	f.refunds, err = contract.New[RefundIssued](contract.Config{Type: "refund.issued.v1", AggregateIDField: "orderId"})
	require.NoError(t, err)
	doc, err := f.refunds.JSONSchema()
	require.NoError(t, err)
	schema, err := failures.CompileContract("refund.issued.v1", doc)
	require.NoError(t, err)
	f.explorer, err = failures.New(failures.Config{DB: db.Pool, Schema: db.Schema, Kafka: f.kc, Publisher: pub,
		Contracts: failures.Contracts{"refund.issued.v1": schema}})
	require.NoError(t, err)
	return f
}

// poisoned publishes a refund to the poison topic as the PoisonQueue
// middleware would, with amount in its payload as given.
func (f *fixture) poisoned(t *testing.T, order, amount, reason string) string {
	t.Helper()
	m, err := f.refunds.Message(context.Background(), RefundIssued{OrderID: order, Amount: "1.00"})
	require.NoError(t, err)
	var doc map[string]any
	require.NoError(t, json.Unmarshal(m.Payload, &doc))
	doc["amount"] = amount
	m.Payload, err = json.Marshal(doc)
	require.NoError(t, err)
	m.Metadata.Set(wmiddleware.PoisonedTopicKey, f.orders)
	m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reason)
	require.NoError(t, f.pub.Publish(f.poison, m))
	return m.Metadata.Get(publisher.MetadataEventID)
}

// onOrders reads what the original topic holds.
func (f *fixture) onOrders(t *testing.T) []poison.Record {
	t.Helper()
	p, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: f.kc, Topic: f.orders})
	require.NoError(t, err)
	return p.Records
}

func loc(p int32, o int64) []auditsql.Location { return []auditsql.Location{{Partition: p, Offset: o}} }

// Replay, discard and edit-and-replay each write their audit row; the page
// shows what was done to each record; a filtered replay leaves the records
// already handled alone; an edit is refused when it breaks the contract or
// changes the event id, and otherwise replays the edited payload under the
// same event id, its original kept in the trail.
func TestActions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	id0 := f.poisoned(t, "o-1", "10.00", "provider timeout")
	id1 := f.poisoned(t, "o-2", "11.00", "provider timeout")
	id2 := f.poisoned(t, "o-3", "12.345", "contract refund.issued.v1: amount")

	e, err := f.explorer.Replay(ctx, failures.Action{Actor: "alice", Topic: f.poison, Locations: loc(0, 0)})
	require.NoError(t, err)
	require.Equal(t, auditsql.ResultOK, e.Result)
	require.Equal(t, []auditsql.Message{{Partition: 0, Offset: 0, EventID: id0}}, e.Messages)
	got := f.onOrders(t)
	require.Len(t, got, 1)
	require.Equal(t, id0, got[0].EventID)

	_, err = f.explorer.Discard(ctx, failures.Action{Actor: "bob", Topic: f.poison, Locations: loc(0, 1)})
	require.NoError(t, err)

	page, err := f.explorer.Page(ctx, f.poison, poison.Filter{}, nil, 10)
	require.NoError(t, err)
	require.Len(t, page.Rows, 3)
	require.Equal(t, auditsql.ActionReplay, page.Rows[0].Done.Action)
	require.Equal(t, "alice", page.Rows[0].Done.Actor)
	require.Equal(t, auditsql.ActionDiscard, page.Rows[1].Done.Action)
	require.Nil(t, page.Rows[2].Done)

	reasons, scanned, err := f.explorer.Reasons(ctx, f.poison, poison.Filter{}, 100)
	require.NoError(t, err)
	require.Equal(t, 3, scanned)
	require.Equal(t, "provider timeout", reasons[0].Reason)
	require.Equal(t, 2, reasons[0].Count)
	require.Equal(t, []string{f.orders}, reasons[0].Topics)

	// A filtered replay: only the record nobody handled yet.
	e, err = f.explorer.Replay(ctx, failures.Action{Actor: "alice", Topic: f.poison, Filter: &poison.Filter{}})
	require.NoError(t, err)
	require.Equal(t, []auditsql.Message{{Partition: 0, Offset: 2, EventID: id2}}, e.Messages)
	require.JSONEq(t, `{}`, string(e.Filter), "the filter's fields that are set")
	require.Len(t, f.onOrders(t), 2)

	original := `{"amount":"12.345","eventId":"` + id2 + `","eventType":"refund.issued.v1","orderId":"o-3"}`
	for _, bad := range []string{
		`{"amount":"twelve","eventId":"` + id2 + `","eventType":"refund.issued.v1","orderId":"o-3"}`,
		`{"amount":"12.34","eventId":"` + id1 + `","eventType":"refund.issued.v1","orderId":"o-3"}`,
		`{"amount":"12.34","eventType":"refund.issued.v1","orderId":"o-3"}`,
		`not json`,
	} {
		e, err = f.explorer.EditReplay(ctx, failures.Action{Actor: "carol", Topic: f.poison, Locations: loc(0, 2), Payload: []byte(bad)})
		require.ErrorIs(t, err, failures.ErrInvalidEdit, bad)
		require.Equal(t, auditsql.ResultRefused, e.Result)
		require.NotZero(t, e.ID, "the refusal is in the trail")
	}
	require.Len(t, f.onOrders(t), 2, "nothing published for a refused edit")

	fixed := `{"amount":"12.34","eventId":"` + id2 + `","eventType":"refund.issued.v1","orderId":"o-3"}`
	e, err = f.explorer.EditReplay(ctx, failures.Action{Actor: "carol", Topic: f.poison, Locations: loc(0, 2), Payload: []byte(fixed)})
	require.NoError(t, err)
	require.Equal(t, auditsql.ResultOK, e.Result)
	got = f.onOrders(t)
	require.Len(t, got, 3)
	require.Equal(t, id2, got[2].EventID)
	require.Equal(t, fixed, string(got[2].Payload))
	require.Equal(t, id2, got[2].Metadata.Get(publisher.MetadataEventID))
	var kept []byte
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT original_payload FROM idem_audit_message WHERE audit_id = $1`, e.ID).Scan(&kept))
	require.JSONEq(t, original, string(kept))

	trail, err := auditsql.List(ctx, f.db.Pool, f.db.Schema, 0, 100)
	require.NoError(t, err)
	var actions []string
	for i := len(trail) - 1; i >= 0; i-- {
		actions = append(actions, trail[i].Actor+" "+trail[i].Action+" "+trail[i].Result)
	}
	require.Equal(t, []string{"alice replay ok", "bob discard ok", "alice replay ok",
		"carol edit_replay refused", "carol edit_replay refused", "carol edit_replay refused", "carol edit_replay refused",
		"carol edit_replay ok"}, actions)
	require.True(t, strings.Contains(trail[3].Detail, "eventId must stay"), trail[3].Detail)
}

// An edit without a contract for its type is refused: nothing is replayed
// unchecked.
func TestEditWithoutContractRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	id := f.poisoned(t, "o-1", "1.000", "bad amount")
	ex, err := failures.New(failures.Config{DB: f.db.Pool, Schema: f.db.Schema, Kafka: f.kc, Publisher: f.pub})
	require.NoError(t, err)
	_, err = ex.EditReplay(ctx, failures.Action{Actor: "dave", Topic: f.poison, Locations: loc(0, 0),
		Payload: []byte(`{"amount":"1.00","eventId":"` + id + `","eventType":"refund.issued.v1","orderId":"o-1"}`)})
	require.ErrorIs(t, err, failures.ErrInvalidEdit)
	require.ErrorContains(t, err, "no contract for event type")
	require.Empty(t, f.onOrders(t))
}

// The history of a known set of heartbeats: its instances and a chart per
// counter drawn from the series.
func TestReadHistory(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(ctx, db.Pool, failures.MigrationLines(db.Schema)...))
	db.Exec(t, `INSERT INTO idem_heartbeat (instance, started_at, at, mode, processed, failed, outbox_backlog) VALUES
('billing-1', now() - interval '2 hours', now() - interval '3 minutes', 'lease', 100, 0, 17),
('billing-1', now() - interval '2 hours', now() - interval '2 minutes', 'lease', 130, 2, 4)`)
	h, err := failures.ReadHistory(ctx, db.Pool, db.Schema, time.Hour, time.Minute)
	require.NoError(t, err)
	require.Len(t, h.Instances, 1)
	require.Equal(t, "lease", h.Instances[0].Mode)
	require.Len(t, h.Charts, 5)
	require.Equal(t, "processed per minute", h.Charts[0].Title)
	require.Contains(t, h.Charts[0].SVG, `data-max="30"`)
	require.Contains(t, h.Charts[2].SVG, `data-max="2"`)
	require.Contains(t, h.Charts[4].SVG, `data-max="17"`)
}
