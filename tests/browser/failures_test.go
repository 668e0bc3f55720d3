package browser_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

// RefundIssued is the refunds service's event in the failures tests.
type RefundIssued struct {
	EventID  string `json:"eventId" validate:"required,uuid"`
	RefundID string `json:"refundId" validate:"required"`
	OrderID  string `json:"orderId" validate:"required"`
	Amount   string `json:"amount" validate:"required,decimal=2"`
	Currency string `json:"currency" validate:"required,iso4217"`
}

// refundsWorld is a refunds consumer behind the dedup middleware, its
// poison topic filled with failed refunds, and the contracts directory the
// console checks edits with.
type refundsWorld struct {
	db        *pgtest.DB
	brokers   []string
	refunds   string // the original topic
	poison    string
	contracts string
	ids       []string
	pub       message.Publisher
	dedup     *idem.Dedup
}

func newRefundsWorld(t *testing.T, n int) *refundsWorld {
	t.Helper()
	ctx := context.Background()
	db := bin.ConsoleDB(t, "plain") // idemctl migrate up: the console's audit and heartbeat tables too
	db.Exec(t, `CREATE TABLE refund_ledger (event_id uuid NOT NULL, refund_id text NOT NULL, amount text NOT NULL)`)
	broker := kafkatest.Start(t)
	w := &refundsWorld{db: db, brokers: broker.Addrs}
	w.refunds, w.poison = "payments.refund-issued", "payments.refund-issued.poison"
	if broker.Fake == nil { // a shared cluster: names of this test's own
		w.refunds, w.poison = broker.Topic(t, w.refunds, 2), broker.Topic(t, w.poison, 2)
	} else { // the test's own broker: the names the screenshots show
		require.NoError(t, kafkatest.CreateTopic(broker.Addrs, w.refunds, 2))
		require.NoError(t, kafkatest.CreateTopic(broker.Addrs, w.poison, 2))
	}
	kc := idemkafka.ClientConfig{Brokers: broker.Addrs}
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	w.pub = pub

	refunds, err := contract.New[RefundIssued](contract.Config{Type: "payments.refund_issued.v1", AggregateIDField: "orderId"})
	require.NoError(t, err)
	w.contracts = t.TempDir()
	doc, err := refunds.JSONSchema()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(w.contracts+"/payments.refund_issued.v1.json", doc, 0o644))

	reasons := []string{"payment provider: 503 Service Unavailable", "payment provider: card_declined", "contract payments.refund_issued.v1: amount: decimal=2"}
	for i := range n {
		m, err := refunds.Message(ctx, RefundIssued{RefundID: fmt.Sprintf("rf_%05d", 4100+i), OrderID: fmt.Sprintf("ord_%05d", 88200+i%37),
			Amount: fmt.Sprintf("%d.%02d", 10+i%90, i%100), Currency: "EUR"})
		require.NoError(t, err)
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, w.refunds)
		m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reasons[i%3])
		m.Metadata.Set(wmiddleware.PoisonedHandlerKey, "refund-ledger")
		m.Metadata.Set("traceparent", fmt.Sprintf("00-4bf92f3577b34da6a3ce929d0e0e%04x-00f067aa0ba902b7-01", i))
		w.ids = append(w.ids, m.Metadata.Get(publisher.MetadataEventID))
		require.NoError(t, pub.Publish(w.poison, m))
	}
	return w
}

// consume runs the refunds consumer: the dedup middleware and a handler
// writing the ledger in the claim's transaction.
func (w *refundsWorld) consume(t *testing.T) {
	t.Helper()
	group := "refund-ledger"
	d, err := idem.NewDedup(idem.Config{DB: w.db.Pool, ConsumerGroup: group, Table: deduplicator.TableConfig{Schema: w.db.Schema}}, nil)
	require.NoError(t, err)
	w.dedup = d
	sc, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: w.brokers}, group)
	require.NoError(t, err)
	sub, err := kafka.NewSubscriber(sc, watermill.NopLogger{})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(d.Middleware)
	router.AddConsumerHandler("refund-ledger", w.refunds, sub, func(m *message.Message) error {
		var ev RefundIssued
		if err := json.Unmarshal(m.Payload, &ev); err != nil {
			return idem.Permanent(err)
		}
		ctx := m.Context()
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO refund_ledger VALUES ($1, $2, $3)`, ev.EventID, ev.RefundID, ev.Amount)
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close(); cancel(); <-done; _ = sub.Close() })
	<-router.Running()
}

func (w *refundsWorld) serve(t *testing.T) string {
	t.Helper()
	return bin.StartServe(t, w.db, []string{"IDEMCTL_TOKEN=" + ctltest.Token, "KAFKA_BROKERS=" + strings.Join(w.brokers, ",")},
		"--allow-actions", "--contracts", w.contracts)
}

// confirmAs fills the confirm page with a name and the token and submits.
func confirmAs(name string) []chromedp.Action[chromedp.Void] {
	return []chromedp.Action[chromedp.Void]{chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("actor"), name), chromedp.SendKeys(chromedp.ID("token"), ctltest.Token),
		click("#confirm"), chromedp.WaitVisible(chromedp.ID("result"))}
}

// The explorer pages through a poison topic by offset: every record once,
// 50 a page; the reasons are grouped; a replay from a record's page reaches
// the consumer exactly once, even replayed twice; an edit that breaks the
// contract is refused and nothing is published; a discard marks the record;
// the audit page shows each action with who did it and its result.
func TestBrowserFailuresExplorer(t *testing.T) {
	t.Parallel()
	ctx, dialogs := browser(t)
	w := newRefundsWorld(t, 120)
	w.consume(t)
	base := w.serve(t)

	do(t, ctx, chromedp.Navigate(base+"/failures"), chromedp.WaitVisible(chromedp.ID("records-table")))
	require.Equal(t, w.poison, eval[string](t, ctx, `document.getElementById("topic").value`))
	require.Equal(t, []int{40, 40, 40}, eval[[]int](t, ctx, `Array.from(document.querySelectorAll("tr.reason-group")).map(e => +e.dataset.count)`))
	seen := map[string]bool{}
	for page := 1; ; page++ {
		locs := eval[[]string](t, ctx, `Array.from(document.querySelectorAll("tr.record")).map(e => e.dataset.partition + "@" + e.dataset.offset)`)
		require.LessOrEqual(t, len(locs), 50)
		for _, l := range locs {
			require.False(t, seen[l], "record %s on two pages", l)
			seen[l] = true
		}
		if !eval[bool](t, ctx, `!!document.getElementById("next-page")`) {
			require.Equal(t, 3, page)
			break
		}
		do(t, ctx, click("#next-page"), chromedp.WaitVisible(chromedp.ID("records-table")))
	}
	require.Len(t, seen, 120)
	screenshot(t, ctx, base+"/failures", "records-table", "console-failures.png")

	// A record's page, then replay it: the consumer applies it once.
	do(t, ctx, chromedp.Navigate(base+"/failures"), chromedp.WaitVisible(chromedp.ID("records-table")),
		click(`tr.record a`), chromedp.WaitVisible(chromedp.ID("payload")))
	id := text(t, ctx, "#event-id")
	require.Contains(t, text(t, ctx, "#payload"), id)
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e", text(t, ctx, "#trace-id")[:28])
	detail := eval[string](t, ctx, `location.href`)
	screenshot(t, ctx, detail, "payload", "console-failure-record.png")
	applied := func() int { return w.db.Count(t, `SELECT 1 FROM refund_ledger WHERE event_id = $1`, id) }
	for range 2 {
		do(t, ctx, chromedp.Navigate(detail), chromedp.WaitVisible(chromedp.ID("replay")), click("#replay"))
		do(t, ctx, confirmAs("alice.oncall")...)
		require.Equal(t, "ok", eval[string](t, ctx, `document.getElementById("result").dataset.result`))
	}
	// Both copies reach the consumer: the first is applied, the second is a
	// duplicate for its claim.
	require.Eventually(t, func() bool { return w.dedup.Stats().Duplicates == 1 }, time.Minute, 50*time.Millisecond)
	require.Equal(t, 1, applied(), "exactly once")
	require.Equal(t, 1, w.db.Count(t, `SELECT 1 FROM processed_event WHERE event_id = $1`, id))

	// Edit and replay with an amount the contract refuses: refused, the
	// trail keeps it, nothing reaches the consumer.
	do(t, ctx, chromedp.Navigate(base+"/failures?from=0:5,1:5"), chromedp.WaitVisible(chromedp.ID("records-table")),
		click(`tr.record a`), chromedp.WaitVisible(chromedp.ID("edit-payload")))
	edited := eval[string](t, ctx, `location.href`)
	do(t, ctx, chromedp.Evaluate[chromedp.Void](`document.getElementById("edit-payload").value = document.getElementById("edit-payload").value.replace(/"amount": "[^"]*"/, '"amount": "12.345"')`),
		click("#edit-replay"), chromedp.WaitVisible(chromedp.ID("preview")))
	require.Contains(t, text(t, ctx, "#preview"), `"amount": "12.345"`)
	do(t, ctx, confirmAs("bob.payments")...)
	require.Equal(t, "refused", eval[string](t, ctx, `document.getElementById("result").dataset.result`))
	require.Contains(t, text(t, ctx, "#result"), "amount")

	// Discard it instead: the explorer shows it as handled.
	do(t, ctx, chromedp.Navigate(edited), chromedp.WaitVisible(chromedp.ID("discard")), click("#discard"))
	do(t, ctx, confirmAs("bob.payments")...)
	do(t, ctx, chromedp.Navigate(edited), chromedp.WaitVisible(chromedp.ID("done")))
	require.Contains(t, text(t, ctx, "#done"), "discard by bob.payments")

	do(t, ctx, chromedp.Navigate(base+"/audit"), chromedp.WaitVisible(chromedp.ID("audit-table")))
	rows := eval[[]string](t, ctx, `Array.from(document.querySelectorAll("tr.audit-row")).map(e => e.dataset.actor + " " + e.dataset.action + " " + e.dataset.result)`)
	require.Equal(t, []string{"bob.payments discard ok", "bob.payments edit_replay refused", "alice.oncall replay ok", "alice.oncall replay ok"}, rows)
	require.Equal(t, 1, applied(), "exactly once")
	require.Zero(t, w.db.Count(t, `SELECT 1 FROM refund_ledger WHERE amount = '12.345'`))
	require.Zero(t, dialogs.Load())
}

// The history page draws its charts from a known series of heartbeats.
func TestBrowserHistoryCharts(t *testing.T) {
	t.Parallel()
	ctx, dialogs := browser(t)
	db := bin.ConsoleDB(t, "plain")
	db.Exec(t, `WITH m AS (SELECT date_bin('1 minute', now(), 'epoch') AS m)
INSERT INTO idem_heartbeat (instance, started_at, at, consumer_group, mode, version, processed, duplicates, failed, outbox_backlog)
SELECT 'refund-ledger-7f9c-1', m - interval '2 hours', m - a * interval '1 minute' + interval '5 seconds', 'refund-ledger', 'lease', 'v1.4.2', p, d, f, o
FROM m, (VALUES (5, 1000, 10, 0, 2), (4, 1120, 12, 1, 35), (3, 1300, 12, 1, 9), (2, 1360, 20, 4, 0)) v(a, p, d, f, o)`)
	base := bin.StartServe(t, db, nil)
	do(t, ctx, chromedp.Navigate(base+"/history"), chromedp.WaitVisible(chromedp.CSS("svg.chart")))
	values := eval[[]string](t, ctx, `Array.from(document.querySelectorAll("svg.chart")).map(e => e.dataset.values)`)
	require.Len(t, values, 5)
	tail := func(s string) string { p := strings.Split(s, ","); return strings.Join(p[len(p)-5:], ",") }
	require.Equal(t, "120,180,60,0,0", tail(values[0]), "processed per minute") // 4, 3, 2 minutes ago, then nothing
	require.Equal(t, "2,0,8,0,0", tail(values[1]))
	require.Equal(t, "1,0,3,0,0", tail(values[2]))
	require.Equal(t, "35,9,0,0,0", tail(values[4]), "the outbox backlog: a gauge")
	require.Equal(t, "180", eval[string](t, ctx, `document.querySelector("svg.chart").dataset.max`))
	require.Equal(t, len(strings.Split(values[0], ",")), eval[int](t, ctx, `document.querySelector("svg.chart polyline").getAttribute("points").split(" ").length`), "one point per value")
	require.Equal(t, "lease", eval[string](t, ctx, `document.querySelector('tr.instance td:nth-child(3)').textContent`))
	require.Equal(t, "0", text(t, ctx, "tr.instance td.backlog"), "its last sample's backlog")
	screenshot(t, ctx, base+"/history", "instances-table", "console-history.png")

	// The overview draws the same charts (their peaks: a minute may turn
	// between the two pages).
	do(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("history")))
	require.Equal(t, []string{"180", "8", "3", "0", "35"}, eval[[]string](t, ctx, `Array.from(document.querySelectorAll("#history svg.chart")).map(e => e.dataset.max)`))
	require.Equal(t, "1 instances wrote a heartbeat in the last hour", text(t, ctx, "#history-instances"))
	require.Zero(t, dialogs.Load())
}

// screenshot opens u, waits for the element id and, with
// -update-screenshots, writes the page to docs/name.
func screenshot(t *testing.T, ctx context.Context, u, id, name string) {
	t.Helper()
	if !*updateScreenshots {
		return
	}
	do(t, ctx, chromedp.Navigate(u), chromedp.WaitVisible(chromedp.ID(id)))
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile("../../docs/"+name, shot, 0o644))
}
