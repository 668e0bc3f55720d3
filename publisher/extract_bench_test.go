package publisher

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"
)

// benchPayloads are a reference-layout event (eventId first, ~1 KB) and
// 1 MB payloads with and without the field.
func benchPayloads() []struct {
	name    string
	payload []byte
} {
	id := uuid.Must(uuid.NewV7()).String()
	blob := strings.Repeat("x", 1<<20)
	return []struct {
		name    string
		payload []byte
	}{
		{"1KB", []byte(`{"eventId":"` + id + `","eventType":"order.confirmed.v1","occurredAt":"2026-01-02T03:04:05Z","orderId":"ord-1","lines":[` +
			strings.Repeat(`{"sku":"abc","qty":1,"price":"1.00"},`, 20) + `{}]}`)},
		{"1MB", []byte(`{"eventId":"` + id + `","blob":"` + blob + `"}`)},
		{"1MB-no-eventId", []byte(`{"orderId":"ord-1","blob":"` + blob + `"}`)},
	}
}

// BenchmarkPayloadEventID runs on every stamped and every consumed message. The
// baseline is what the consumer did before (json.Unmarshal into a struct
// with one field), for a same-run ratio.
func BenchmarkPayloadEventID(b *testing.B) {
	for _, p := range benchPayloads() {
		b.Run(p.name, func(b *testing.B) {
			b.SetBytes(int64(len(p.payload)))
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := payloadID(p.payload); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(p.name+"/baseline-unmarshal", func(b *testing.B) {
			b.SetBytes(int64(len(p.payload)))
			b.ReportAllocs()
			for b.Loop() {
				var v struct {
					EventID *json.RawMessage `json:"eventId"`
				}
				if err := json.Unmarshal(p.payload, &v); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
