package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// TestDemo runs the demo's whole scenario, small: real PostgreSQL, the
// Kafka-protocol broker, every injected fault (the crash and the takeover
// with child processes: this test binary, re-executed), and all
// invariants. The idle-in-transaction bound of the slowdown is a `make demo`
// check (timing, on a shared machine): here it is reported only, and the
// test checks that the sampler ran.
func TestDemo(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	t.Parallel()
	var progress bytes.Buffer
	rep, err := runDemo(context.Background(), demoConfig{
		DatabaseURL:          pgtest.URL(),
		Brokers:              kafkatest.External(),
		Orders:               40,
		Partitions:           4, // 2 instances + the 2 child processes of phase 3
		BillingInstances:     2,
		BillingInFlight:      4,
		LeaseConcurrency:     1,
		RedeliverEvery:       4,
		ConcurrentDuplicates: 3,
		LostResponses:        2,
		ConcurrentLatency:    50 * time.Millisecond,
		SlowOrders:           6,
		CrashAndTakeover:     true,
		Progress:             &progress,
	})
	require.NoError(t, err, progress.String())
	var out bytes.Buffer
	printReport(&out, rep)
	t.Log("\n" + progress.String() + out.String())

	require.Empty(t, rep.Violations)
	const orders = 40 + 6 + 2 + 3 // phase 1, the slowdown, the crash and the takeover, the concurrent copies
	require.Equal(t, orders, rep.Orders)
	require.Equal(t, orders, rep.Provider.Charges, "one charge per order")
	require.Equal(t, orders, rep.ProviderKeys, "one Idempotency-Key per order")
	require.Equal(t, orders, rep.ProviderKeysOnce, "each executed once by the provider")
	require.Equal(t, orders, rep.LedgerRows)
	require.Equal(t, orders, rep.LedgerEventsOnce, "one ledger row per event")
	require.Equal(t, orders, rep.Notifications)
	require.Equal(t, 2, rep.Provider.Dropped)
	require.GreaterOrEqual(t, rep.Provider.Replayed, 2+2, "each lost response, the crash and the takeover are followed by a call with the same key")
	require.GreaterOrEqual(t, rep.Billing.Failed, int64(2), "each lost response fails the billing delivery")
	require.Equal(t, 10, rep.Republished)
	require.Equal(t, 12, rep.ConcurrentSent)
	require.Equal(t, 3, rep.Malformed)
	require.Equal(t, orders+10+12+3, rep.Published)
	require.GreaterOrEqual(t, rep.OnTopic, rep.Published)

	// Lease mode's faults.
	require.Equal(t, 6, rep.SlowOrders)
	require.Positive(t, rep.Idle.Samples, "the idle-in-transaction sampler ran during the slowdown")
	require.Contains(t, out.String(), "idle in transaction during the slowdown: max")
	require.Contains(t, rep.Crash, "SIGKILLed after the provider call")
	require.Contains(t, rep.Takeover, "taken over while it was frozen in its call")
	require.Contains(t, rep.Takeover, "lease lost", "the first owner wrote nothing")
	require.GreaterOrEqual(t, rep.TakenOverInPhase, uint64(2), "the crashed and the frozen owner's leases were taken over")
	require.GreaterOrEqual(t, rep.Provider.InFlight, 1, "the takeover's call met the first owner's in progress")
	require.GreaterOrEqual(t, rep.Leases.TakenOver, uint64(2))
	require.GreaterOrEqual(t, rep.Leases.Taken, uint64(orders), "billing ran in lease mode")

	injected := uint64(10 + 12 + rep.Resent())
	for name, g := range map[string]groupReport{"billing": rep.Billing, "notification": rep.Notification} {
		require.Equal(t, uint64(orders), g.Processed, name)
		require.Equal(t, orders, g.Claims, name)
		// A rebalance redelivers records whose offsets were not committed
		// yet: at least the injected duplicates are skipped, maybe more.
		require.GreaterOrEqual(t, g.Skipped, injected, name)
		require.GreaterOrEqual(t, g.Rejected, int64(3), name)
		require.Equal(t, int64(g.Skipped-injected)+g.Rejected-3, int64(g.KafkaRedelivered), "%s: every extra skip or rejection is a record Kafka delivered again", name)
		require.Equal(t, g.Deliveries, int64(g.Processed)+int64(g.Skipped)+g.Rejected+g.Failed, "%s: deliveries add up", name)
		require.Equal(t, uint64(g.Rejected+g.Failed), g.MiddlewareErrors, name)
		require.Equal(t, rep.OnTopic, g.Records, "%s: every record delivered to the end", name)
		require.Equal(t, int(g.Rejected), g.Poisoned, "%s: one poison record per rejection", name)
		require.Equal(t, 3, g.PoisonedEvents, name)
	}
	require.Contains(t, out.String(), "OK: every order charged once")

	// The printed trace: order 4's response was lost once and its event
	// published twice. One processed span per group, the failed attempt
	// and its retry with the same Idempotency-Key, a duplicate per group.
	require.Equal(t, "ord-00004", rep.TracedOrder)
	require.True(t, rep.TracedLost)
	require.True(t, rep.TracedRepublished)
	require.Contains(t, out.String(), "the trace of order ord-00004")
	tr := rep.Trace
	require.True(t, strings.HasPrefix(tr, "confirm order "), tr)
	require.Equal(t, 1, strings.Count(tr, "confirm order"), tr)
	require.Equal(t, 1, countLines(tr, "billing", "outcome=processed"), tr)
	require.Equal(t, 1, countLines(tr, "notification", "outcome=processed"), tr)
	require.GreaterOrEqual(t, countLines(tr, "billing", "outcome=failed"), 1, tr)
	require.GreaterOrEqual(t, countLines(tr, "billing", "outcome=duplicate"), 1, tr)
	require.GreaterOrEqual(t, countLines(tr, "notification", "outcome=duplicate"), 1, tr)
	require.GreaterOrEqual(t, countLines(tr, "linked: send "+TopicOrdersConfirmed, "outbox-forwarder"), 1, tr)
	require.GreaterOrEqual(t, countLines(tr, "linked: send "+TopicBillingCharged, "outbox-forwarder"), 1, tr)
	keys := regexp.MustCompile(`idempotency_key=(\S+)`).FindAllStringSubmatch(tr, -1)
	require.GreaterOrEqual(t, len(keys), 2, "the failed attempt and the processed one: %s", tr)
	for _, k := range keys {
		require.Equal(t, keys[0][1], k[1], "every attempt sends the same Idempotency-Key")
	}
	for _, line := range strings.Split(tr, "\n") {
		if strings.Contains(line, "outcome=duplicate") {
			require.NotContains(t, line, "idempotency_key", "a duplicate's handler does not run")
		}
	}
}

// countLines counts the lines of s that contain every one of parts.
func countLines(s string, parts ...string) int {
	n := 0
	for _, line := range strings.Split(s, "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}

// With Brokers set (a real cluster), topics and groups get a per-run suffix,
// and every service must use the suffixed names: only those outbox topics
// are migrated.
func TestDemo_BrokersSetUsesSuffixedNames(t *testing.T) {
	t.Parallel()
	var progress bytes.Buffer
	rep, err := runDemo(context.Background(), demoConfig{
		DatabaseURL:          pgtest.URL(),
		Brokers:              kafkatest.Start(t).Addrs,
		Orders:               10,
		Partitions:           2,
		BillingInstances:     1,
		BillingInFlight:      4,
		LeaseConcurrency:     1,
		RedeliverEvery:       5,
		ConcurrentDuplicates: 1,
		LostResponses:        1,
		Progress:             &progress,
	})
	require.NoError(t, err, progress.String())
	require.Contains(t, progress.String(), "topics and groups suffixed")
	require.Empty(t, rep.Violations, progress.String())
	require.Equal(t, 11, rep.LedgerRows)
}

// The group checks are exact: a consistent report passes, and each count off
// by one (a skip the middleware did not count, a delivery counted twice, a
// lost record...) breaks at least one of them.
func TestGroupViolations(t *testing.T) {
	t.Parallel()
	rep := &report{Orders: 10, Republished: 2, ConcurrentSent: 3, Malformed: 3}
	rep.Published = 10 + 2 + 3 + 3
	rep.OnTopic = rep.Published
	good := groupReport{
		Processed: 10, Skipped: 5 + 2, Rejected: 3 + 1, Failed: 2,
		MiddlewareErrors: 4 + 2, Records: rep.OnTopic, KafkaRedelivered: 3, Poisoned: 4, PoisonedEvents: 3,
	}
	good.Deliveries = good.Added()
	require.Empty(t, groupViolations(rep, "g", good))

	for name, tc := range map[string]struct {
		mutate func(*groupReport)
		want   string
	}{
		"skip not counted":          {func(g *groupReport) { g.Skipped--; g.KafkaRedelivered-- }, "deliveries"},
		"delivery counted twice":    {func(g *groupReport) { g.Deliveries++ }, "deliveries"},
		"error not counted":         {func(g *groupReport) { g.MiddlewareErrors-- }, "the middleware counted"},
		"processed twice":           {func(g *groupReport) { g.Processed++; g.Deliveries++; g.Records++ }, "handler committed"},
		"fewer skips than injected": {func(g *groupReport) { g.Skipped = 4; g.Deliveries = g.Added() }, "want at least 5"},
		"record never ended":        {func(g *groupReport) { g.Records-- }, "records on the topic"},
		"redelivery not seen":       {func(g *groupReport) { g.KafkaRedelivered-- }, "Kafka delivered"},
		"rejection not poisoned":    {func(g *groupReport) { g.Poisoned-- }, "poison topic"},
		"malformed event missing":   {func(g *groupReport) { g.PoisonedEvents-- }, "distinct messages"},
	} {
		g := good
		tc.mutate(&g)
		v := groupViolations(rep, "g", g)
		require.NotEmpty(t, v, name)
		require.Contains(t, strings.Join(v, "\n"), tc.want, name)
	}
}

// A negative control: with a provider that ignores the Idempotency-Key, each
// lost response turns into a second charge, and the demo must report it (the
// dedup table alone cannot prevent it: the first transaction rolled back).
func TestDemo_DetectsDoubleChargesWhenTheProviderIgnoresKeys(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	t.Parallel()
	var progress bytes.Buffer
	rep, err := runDemo(context.Background(), demoConfig{
		DatabaseURL:         pgtest.URL(),
		Brokers:             kafkatest.External(),
		Orders:              20,
		Partitions:          2,
		BillingInstances:    1,
		LeaseConcurrency:    1,
		LostResponses:       2,
		Progress:            &progress,
		providerIgnoresKeys: true,
	})
	require.NoError(t, err, progress.String())
	require.Equal(t, 22, rep.Provider.Charges, "two orders charged twice")
	require.Zero(t, rep.Provider.Replayed)
	require.Equal(t, 20, rep.LedgerRows, "our side still books each order once")
	require.NotEmpty(t, rep.Violations)
	var out bytes.Buffer
	printReport(&out, rep)
	require.Contains(t, out.String(), "FAILED")
	require.Contains(t, out.String(), "was charged 2 times")
	require.Contains(t, out.String(), "executed 2 times", "the provider's own key table shows it too")
}

// A negative control of the idle-in-transaction check: billing in
// transaction mode keeps its transaction open across each 1-2 s charge of
// the slowdown, and the demo must report it (a bound of 100 ms against
// calls of at least 1 s).
func TestDemo_DetectsIdleTransactionsInTransactionMode(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	t.Parallel()
	var progress bytes.Buffer
	rep, err := runDemo(context.Background(), demoConfig{
		DatabaseURL:      pgtest.URL(),
		Brokers:          kafkatest.External(),
		Orders:           4,
		Partitions:       2,
		BillingInstances: 1,
		BillingInFlight:  2,
		SlowOrders:       2,
		IdleInTxLimit:    100 * time.Millisecond,
		Progress:         &progress,
		billingTxMode:    true,
	})
	require.NoError(t, err, progress.String())
	require.Equal(t, 6, rep.LedgerRows, "still exactly once")
	var out bytes.Buffer
	printReport(&out, rep)
	require.Contains(t, out.String(), "FAILED", progress.String())
	require.Contains(t, out.String(), "a transaction held across a call", "billing's own transaction, open across the call")
	require.Contains(t, out.String(), "/billing, in a transaction 1.")
	require.Contains(t, out.String(), "billing in transaction mode")
}

func TestProvider_IdempotencyKeySemantics(t *testing.T) {
	t.Parallel()
	p, err := newPaymentProvider(0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })

	post := func(key, body string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, p.URL()+"/charges", strings.NewReader(body))
		require.NoError(t, err)
		if key != "" {
			req.Header.Set(idem.IdempotencyKeyHeader, key)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, string(raw)
	}
	body := `{"orderId":"o1","customerId":"c1","amount":"10.00","currency":"EUR"}`

	r1, b1 := post("k1", body)
	require.Equal(t, http.StatusCreated, r1.StatusCode)
	r2, b2 := post("k1", body)
	require.Equal(t, http.StatusCreated, r2.StatusCode)
	require.Equal(t, b1, b2, "a repeated key returns the first response")
	require.Equal(t, "true", r2.Header.Get("Idempotent-Replayed"))

	r3, _ := post("k1", `{"orderId":"o1","customerId":"c1","amount":"99.00","currency":"EUR"}`)
	require.Equal(t, http.StatusUnprocessableEntity, r3.StatusCode, "a key reused with another body")

	r4, _ := post("", body)
	require.Equal(t, http.StatusBadRequest, r4.StatusCode, "no key")

	r5, _ := post("k2", body)
	require.Equal(t, http.StatusCreated, r5.StatusCode, "a new key is a new charge")

	st := p.Stats()
	require.Equal(t, providerStats{Requests: 5, Charges: 2, Replayed: 1, Mismatched: 1}, st)
	require.Equal(t, map[string]int{"o1": 2}, p.ChargesPerOrder())
}

func TestProvider_InFlightKeyGets409(t *testing.T) {
	t.Parallel()
	p, err := newPaymentProvider(0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	p.SlowCharge("o1", 2*time.Second)
	body := `{"orderId":"o1","customerId":"c1","amount":"10.00","currency":"EUR"}`
	send := func() int {
		req, _ := http.NewRequest(http.MethodPost, p.URL()+"/charges", strings.NewReader(body))
		req.Header.Set(idem.IdempotencyKeyHeader, "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return -1
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	var wg sync.WaitGroup
	var first int
	wg.Add(1)
	go func() { defer wg.Done(); first = send() }()
	require.Eventually(t, func() bool { return p.Stats().Requests == 1 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, http.StatusConflict, send())
	wg.Wait()
	require.Equal(t, http.StatusCreated, first)
	require.Equal(t, 1, p.Stats().Charges)
	require.Equal(t, 1, p.Stats().InFlight)
}

// The lost response, at the HTTP level: the charge is recorded, the client
// gets a cut response; the same key again returns the stored charge.
func TestBillingService_LostResponseSameKeyOneCharge(t *testing.T) {
	t.Parallel()
	p, err := newPaymentProvider(0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	svc := NewBillingService(p.URL())
	p.DropResponse("o1")

	id := uuid.Must(uuid.NewV7())
	ctx := idemctx.With(context.Background(), &idemctx.Value{EventID: id, ConsumerGroup: GroupBilling})
	ev := OrderConfirmed{EventID: id.String(), OrderID: "o1", CustomerID: "c1", TotalAmount: "10.00", Currency: "EUR"}
	msg := newTestMessage(ctx)

	_, err = svc.charge(msg, ev)
	require.ErrorIs(t, err, ErrChargeOutcomeUnknown)
	require.False(t, idem.IsPermanent(err), "a lost response must be retried")
	require.Equal(t, 1, p.Stats().Charges)

	cr, err := svc.charge(msg, ev)
	require.NoError(t, err)
	require.Equal(t, "o1", cr.OrderID)
	st := p.Stats()
	require.Equal(t, 1, st.Charges, "the retry with the same key did not charge again")
	require.Equal(t, 1, st.Replayed)
	require.Equal(t, 1, st.Dropped)
}

func TestBillingService_RefusesWithoutEvent(t *testing.T) {
	t.Parallel()
	p, err := newPaymentProvider(0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	svc := NewBillingService(p.URL())
	_, err = svc.charge(newTestMessage(context.Background()), OrderConfirmed{OrderID: "o1", CustomerID: "c", TotalAmount: "1.00", Currency: "EUR"})
	require.ErrorIs(t, err, idem.ErrNotInHandler)
	require.Zero(t, p.Stats().Requests, "no money call without an Idempotency-Key")
}

func TestDecodeOrderConfirmed(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7())
	ctx := idemctx.With(context.Background(), &idemctx.Value{EventID: id, ConsumerGroup: GroupBilling})
	valid := OrderConfirmed{
		EventID: id.String(), EventType: EventOrderConfirmed, OccurredAt: time.Now().UTC(), AggregateType: "Order",
		OrderID: "o1", CustomerID: "c1", TotalAmount: "129.90", Currency: "EUR",
	}
	enc := func(mut func(*OrderConfirmed)) []byte {
		v := valid
		if mut != nil {
			mut(&v)
		}
		b, err := json.Marshal(v)
		require.NoError(t, err)
		return b
	}
	got, err := decodeOrderConfirmed(payloadMessage(ctx, enc(nil)))
	require.NoError(t, err)
	require.Equal(t, "129.90", got.TotalAmount)

	for name, payload := range map[string][]byte{
		"not json":        []byte("nope"),
		"event type":      enc(func(o *OrderConfirmed) { o.EventType = "order.created.v1" }),
		"aggregate type":  enc(func(o *OrderConfirmed) { o.AggregateType = "Customer" }),
		"no order id":     enc(func(o *OrderConfirmed) { o.OrderID = "" }),
		"no customer id":  enc(func(o *OrderConfirmed) { o.CustomerID = "" }),
		"negative amount": enc(func(o *OrderConfirmed) { o.TotalAmount = "-1.00" }),
		"zero amount":     enc(func(o *OrderConfirmed) { o.TotalAmount = "0.00" }),
		"3 decimals":      enc(func(o *OrderConfirmed) { o.TotalAmount = "1.234" }),
		"currency":        enc(func(o *OrderConfirmed) { o.Currency = "eur" }),
		"no occurredAt":   enc(func(o *OrderConfirmed) { o.OccurredAt = time.Time{} }),
		"eventId differs": enc(func(o *OrderConfirmed) { o.EventID = uuid.Must(uuid.NewV7()).String() }),
		"float amount":    []byte(strings.Replace(string(enc(nil)), `"129.90"`, `129.90`, 1)),
		"duplicate key":   []byte(strings.Replace(string(enc(nil)), `"currency":"EUR"`, `"currency":"EUR","currency":"USD"`, 1)),
	} {
		_, err := decodeOrderConfirmed(payloadMessage(ctx, payload))
		require.Error(t, err, name)
		require.True(t, errors.Is(err, idem.ErrMalformedPayload), name)
		require.True(t, idem.IsPermanent(err), "%s: must go to the poison topic", name)
	}
}

func payloadMessage(ctx context.Context, payload []byte) *message.Message {
	m := message.NewMessage(uuid.NewString(), payload)
	m.SetContext(ctx)
	return m
}

func newTestMessage(ctx context.Context) *message.Message {
	m := message.NewMessage(uuid.NewString(), nil)
	m.SetContext(ctx)
	return m
}
