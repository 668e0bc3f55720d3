package contract

import (
	"strconv"
	"strings"

	"github.com/idemkit/watermill-idempotency/internal/payloaderr"
)

// Error is every refusal of [Contract.Decode] (and of [Contract.Message] for
// an event that its own contract would refuse). It names the field and the
// rule that failed, never the offending value (a payload is untrusted and
// does not belong in logs or a poison-queue reason).
//
// It unwraps to middleware.ErrMalformedPayload, so middleware.IsPermanent
// reports true and a router with watermill's PoisonQueueWithFilter(IsPermanent)
// sends the message to the poison topic instead of retrying it.
type Error struct {
	// Type is the event type of the contract that refused the payload,
	// such as "order.confirmed.v2".
	Type string
	// Field is the JSON path of the field that broke the rule, such as
	// "currency" or "items[2].sku"; empty when the rule is about the whole
	// payload (max_size, json).
	Field string
	// Rule is what failed: a validator tag of the struct ("required",
	// "iso4217", "gt", "decimal", ...), or one of the contract's own rules:
	// "type" (a JSON value of the wrong type, such as a JSON number where a
	// decimal string is declared), "json" (not a JSON object), "duplicate_key",
	// "max_size", "event_type" (missing, wrong or disagreeing event type),
	// "version" (a version this reader cannot read) and "upcast" (the
	// upcaster refused the older event).
	Rule string
	// Param is the rule's parameter, when it has one: the bound of "gt=0",
	// the limit of max_size, the received event type of event_type and
	// version.
	Param string
	// Detail says more for a human; it may be empty.
	Detail string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("contract ")
	b.WriteString(e.Type)
	b.WriteString(": ")
	if e.Field != "" {
		b.WriteString("field ")
		b.WriteString(strconv.Quote(e.Field))
		b.WriteString(" ")
	}
	b.WriteString("breaks rule ")
	b.WriteString(e.Rule)
	if e.Param != "" {
		b.WriteString("=")
		b.WriteString(e.Param)
	}
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	return b.String()
}

// Unwrap returns middleware.ErrMalformedPayload: every contract refusal is
// permanent.
func (e *Error) Unwrap() error { return payloaderr.ErrMalformed }
