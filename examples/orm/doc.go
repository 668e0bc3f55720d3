// Package orm is one small handler written four times, with GORM, bun, ent
// and sqlx, each on the *sql.Tx the dedup middleware hands it when its
// database is a *sql.DB opened with pgx's stdlib driver (idem.SQLDB). The
// handler records a payment: one row in payments, committed with the
// event's claim or not at all. Each registers its write with
// idem.CompleteSQL, so it runs unchanged in transaction mode (the write
// runs at once, in the message's transaction) and in lease mode (in the
// completing transaction). orm_test.go runs each against PostgreSQL:
// a failed attempt leaves nothing, the redelivery applies it once, a
// duplicate runs nothing.
//
// The ORMs live in this module of their own (tied to the library by the
// repository's go.work), so the library's go.mod does not carry them.
package orm

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// PaymentEvent is the message's payload.
type PaymentEvent struct {
	OrderID string `json:"orderId"`
	Amount  int64  `json:"amount"`
}

// Schema is the business table the four handlers write.
const Schema = `CREATE TABLE payments (
	event_id uuid PRIMARY KEY,
	order_id text NOT NULL,
	amount   bigint NOT NULL
)`

// decode reads the payload; a malformed one is permanent (poison queue).
func decode(msg *message.Message) (PaymentEvent, error) {
	var ev PaymentEvent
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return ev, fmt.Errorf("%w: %w", idem.ErrMalformedPayload, err)
	}
	return ev, nil
}
