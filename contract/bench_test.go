package contract_test

import (
	"encoding/json"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BenchmarkDecode measures Decode (size check, duplicate-key scan, type
// check, unmarshal, validation) of a typical event, next to json.Unmarshal
// of the same payload alone, the hand-written decoder's starting point. Run
// with -benchmem; compare the two lines of one run, not figures across
// machines.
func BenchmarkDecode(b *testing.B) {
	c := newOrderConfirmed(b)
	msg := message.NewMessage("m", []byte(goodPayload))
	b.Run("contract", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(goodPayload)))
		for b.Loop() {
			if _, err := c.Decode(msg); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("json.Unmarshal", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(goodPayload)))
		for b.Loop() {
			var ev OrderConfirmed
			if err := json.Unmarshal(msg.Payload, &ev); err != nil {
				b.Fatal(err)
			}
		}
	})
}
