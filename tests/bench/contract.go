package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/contract"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// benchOrderConfirmed is the event of the contract benchmark: the seed's
// order.confirmed.v1, with items.
type benchOrderConfirmed struct {
	EventID     string      `json:"eventId" validate:"required,uuid"`
	EventType   string      `json:"eventType"`
	OccurredAt  time.Time   `json:"occurredAt" validate:"required"`
	OrderID     string      `json:"orderId" validate:"required"`
	CustomerID  string      `json:"customerId" validate:"required"`
	TotalAmount string      `json:"totalAmount" validate:"required,decimal=2,positive"`
	Currency    string      `json:"currency" validate:"required,iso4217"`
	Items       []benchItem `json:"items" validate:"required,min=1,dive"`
}

type benchItem struct {
	SKU        string `json:"sku" validate:"required"`
	Quantity   int    `json:"quantity" validate:"gte=1,lte=1000"`
	PriceMinor int64  `json:"priceMinor" validate:"gte=0"`
}

func orderPayload(id uuid.UUID) []byte {
	return []byte(`{"eventId":"` + id.String() + `","eventType":"order.confirmed.v1",` +
		`"occurredAt":"2026-01-02T03:04:05Z","orderId":"o-1","customerId":"c-1","totalAmount":"129.90","currency":"EUR",` +
		`"items":[{"sku":"A-1","quantity":2,"priceMinor":6495}]}`)
}

func orderMessage(ctx context.Context) *message.Message {
	id := uuid.Must(uuid.NewV7())
	msg := message.NewMessage(id.String(), orderPayload(id))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	msg.Metadata.Set("event_type", "order.confirmed.v1")
	msg.SetContext(ctx)
	return msg
}

// contractDecode compares the dedup path of a handler that reads its event
// with contract.Decode (size, duplicate keys, type, validation) against the
// same handler reading it with json.Unmarshal alone.
func contractDecode(ctx context.Context, o Options) (Section, error) {
	c, err := contract.New[benchOrderConfirmed](contract.Config{Type: "order.confirmed.v1", AggregateIDField: "orderId"})
	if err != nil {
		return Section{}, err
	}
	rig, err := newDedupRig(ctx, o, "contract", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	write := func(msg *message.Message, ev benchOrderConfirmed) error {
		ctx := msg.Context()
		_, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, ev.OrderID, int64(len(ev.Items)))
		return err
	}
	plain := rig.dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		var ev benchOrderConfirmed
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return nil, err
		}
		return nil, write(msg, ev)
	})
	typed := rig.dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ev, err := c.Decode(msg)
		if err != nil {
			return nil, err
		}
		return nil, write(msg, ev)
	})
	op := func(h message.HandlerFunc) func(context.Context) error {
		return func(ctx context.Context) error { _, err := h(orderMessage(ctx)); return err }
	}
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	var rows [][]string
	for _, w := range []int{1, 4} {
		rates, err := Interleave(ctx, rounds, w, d, op(plain), op(typed))
		if err != nil {
			return Section{}, err
		}
		st := Summarise(Ratios(rates[0], rates[1]))
		o.Logf("  contract-decode workers=%d: json.Unmarshal %s msg/s, contract.Decode %s msg/s, ratio %s", w, fmtRate(rates[0]), fmtRate(rates[1]), st)
		rows = append(rows, []string{fmt.Sprint(w), fmtRate(rates[0]), fmtRate(rates[1]), st.String(), pass(st.Median >= 0.9)})
	}

	// The decode alone, without the database: what the ratio above is made of.
	msg := orderMessage(ctx)
	decode := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := c.Decode(msg); err != nil {
				b.Fatal(err)
			}
		}
	})
	unmarshal := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var ev benchOrderConfirmed
			if err := json.Unmarshal(msg.Payload, &ev); err != nil {
				b.Fatal(err)
			}
		}
	})

	var b strings.Builder
	b.WriteString(Table([]string{"workers", "dedup + json.Unmarshal (msg/s, median)", "dedup + contract.Decode (msg/s, median)", "ratio Decode/Unmarshal", "median ≥ 0.9"}, rows))
	fmt.Fprintf(&b, "\nBoth handlers run behind the dedup middleware ({BEGIN + claim}, one business row, COMMIT) and read an "+
		"order.confirmed.v1 event of %d bytes: the baseline with json.Unmarshal alone, the subject with contract.Decode "+
		"(size check, duplicate-key scan, event type, json.Unmarshal, validator tags). Interleaved call by call; %d rounds of %s.\n\n",
		len(msg.Payload), rounds, d)
	b.WriteString(Table([]string{"decode alone, no database", "ns/op", "allocs/op", "B/op"}, [][]string{
		{"json.Unmarshal", fmt.Sprint(unmarshal.NsPerOp()), fmt.Sprint(unmarshal.AllocsPerOp()), fmt.Sprint(unmarshal.AllocedBytesPerOp())},
		{"contract.Decode", fmt.Sprint(decode.NsPerOp()), fmt.Sprint(decode.AllocsPerOp()), fmt.Sprint(decode.AllocedBytesPerOp())},
	}))
	b.WriteString("\ntesting.Benchmark in the same process, one after the other: the absolute cost of a decode, next to a " +
		"message's database round trips (see Round trips per message).\n")
	return Section{Title: "Event contracts: dedup path with contract.Decode vs json.Unmarshal", Markdown: b.String()}, nil
}
