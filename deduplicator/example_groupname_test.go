package deduplicator_test

import (
	"errors"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
)

// A consumer group name PostgreSQL cannot store is refused before any SQL,
// with a typed error naming the field.
func ExampleValidateGroupName() {
	err := deduplicator.ValidateGroupName("ConsumerGroup", "billing\x00")
	fmt.Println(errors.Is(err, deduplicator.ErrInvalidGroupName))
	fmt.Println(err)
	fmt.Println(deduplicator.ValidateGroupName("ConsumerGroup", "facturación"))
	// Output:
	// true
	// ConsumerGroup: "billing\x00" contains a NUL byte, which PostgreSQL cannot store in text
	// <nil>
}
