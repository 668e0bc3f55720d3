package outbox

import (
	"slices"
	"strings"
	"testing"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
)

// fastRecord builds exactly the record idemkafka.Marshaler makes of the
// row's message, and declines (leaving the long way to decode or refuse)
// every row it cannot read byte for byte.
func TestFastRecordMatchesTheMarshaler(t *testing.T) {
	row := func(md string) outboxsql.Row {
		r := outboxsql.Row{TxID: 7, Offset: 3, UUID: "0193d2a4-0000-7000-8000-000000000001", Payload: []byte(`{"amount":1200}`)}
		if md != "-" {
			r.Metadata = []byte(md)
		}
		return r
	}
	same := []outboxsql.Row{
		row(`{"event_id":"0193d2a4-0000-7000-8000-000000000002","partition_key":"order-42","occurred_at":"2026-12-01T20:00:00Z"}`),
		row(`{"event_id":"x"}`), // no partition key: no Kafka key
		row(`{"partition_key":""}`),
		row(`{"clé":"valeur é"}`), // UTF-8
		row(`{}`),
		row(`-`), // NULL metadata
		{UUID: "u", Metadata: []byte(`{"a":"b"}`)}, // NULL payload
	}
	for _, r := range same {
		got, ok := fastRecord("orders", r)
		if !ok {
			t.Fatalf("%s: declined", r.Metadata)
		}
		msg, err := r.Message()
		if err != nil {
			t.Fatal(err)
		}
		want, err := idemkafka.Marshaler{}.Marshal("orders", msg)
		if err != nil {
			t.Fatal(err)
		}
		if got.Topic != want.Topic || enc(t, got.Key) != enc(t, want.Key) || enc(t, got.Value) != enc(t, want.Value) {
			t.Fatalf("%s: record %+v, want %+v", r.Metadata, got, want)
		}
		if h, w := headers(got.Headers), headers(want.Headers); !slices.Equal(h, w) {
			t.Fatalf("%s: headers %v, want %v", r.Metadata, h, w)
		}
	}
	declined := []string{
		`{"a": "b"}`,                      // whitespace
		`{"a":"b\"c"}`,                    // escape
		`{"a":"b","a":"c"}`,               // duplicate key (a map keeps the last)
		`{"_watermill_message_uuid":"x"}`, // reserved: the marshaler refuses it
		`{"a":1}`,                         // not a string
		`null`, `[]`, `{"a":"b"`, "{\"a\":\"\x01\"}",
	}
	for _, md := range declined {
		if _, ok := fastRecord("orders", row(md)); ok {
			t.Errorf("%s: taken, want declined", md)
		}
	}
}

func enc(t *testing.T, e sarama.Encoder) string {
	t.Helper()
	if e == nil {
		return "<nil>"
	}
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if b == nil {
		return "<nil bytes>"
	}
	return string(b)
}

func headers(hs []sarama.RecordHeader) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = string(h.Key) + "=" + string(h.Value)
	}
	slices.SortFunc(out, strings.Compare)
	return out
}
