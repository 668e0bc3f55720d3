package publisher

import (
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
)

// The exported names are spelled out for the reader of the docs; the
// middleware reads the same keys from internal/eventid.
func TestMetadataNamesMatchTheMiddleware(t *testing.T) {
	for got, want := range map[string]string{
		MetadataEventID:       eventid.MetadataEventID,
		MetadataOccurredAt:    eventid.MetadataOccurredAt,
		MetadataCausationID:   eventid.MetadataCausationID,
		MetadataCorrelationID: eventid.MetadataCorrelationID,
		MetadataPartitionKey:  eventid.MetadataPartitionKey,
		PayloadEventIDField:   eventid.PayloadField,
	} {
		if got != want {
			t.Errorf("publisher name %q != internal/eventid name %q", got, want)
		}
	}
}
