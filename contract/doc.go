// Package contract declares event contracts: an event type with its name and
// version ("order.confirmed.v1") and the Go struct that carries it, checked
// on both sides of the topic.
//
// A contract is a [Config] and a struct whose fields carry
// go-playground/validator tags; [New] declares it:
//
//	type OrderConfirmed struct {
//		EventID     string `json:"eventId" validate:"required,uuid"`
//		OrderID     string `json:"orderId" validate:"required"`
//		TotalAmount string `json:"totalAmount" validate:"required,decimal=2"` // "129.90", never a float
//		Currency    string `json:"currency" validate:"required,iso4217"`
//	}
//
//	orderConfirmed, err := contract.New[OrderConfirmed](contract.Config{
//		Type: "order.confirmed.v1", AggregateIDField: "orderId"})
//
// The consumer calls [Contract.Decode] in its handler; the producer builds
// its messages with [Contract.Message] and hands them to any publisher, the
// outbox's included:
//
//	ev, err := orderConfirmed.Decode(msg) // err: an *Error, permanent
//	msg, err := orderConfirmed.Message(ctx, OrderConfirmed{OrderID: "o-1", TotalAmount: "129.90", Currency: "EUR"})
//	err = ob.Publisher(tx).Publish("orders.confirmed", msg)
//
// # The event type on the wire
//
// The event type travels in the event_type metadata (a Kafka header, named
// like publisher's event_id) and in the payload's top-level eventType field,
// as the events of other languages carry it. [Contract.Message] writes both;
// [Contract.Decode] needs either and refuses two that disagree. The header
// lets a router or a tool route by type without parsing the payload; the
// payload field survives any copy of the bytes (a dead-letter dump, a
// replay by another tool).
//
// # Refusals
//
// Every refusal is an *[Error] naming the JSON path of the field and the
// rule it broke, and unwraps to middleware.ErrMalformedPayload, so
// middleware.IsPermanent reports true and the poison queue takes the
// message: a missing or null required field, a JSON value of the wrong type
// (a JSON number where money is a decimal string), a number out of range, a
// currency that is not an ISO 4217 code, another event type or an unknown
// version, duplicate JSON keys (or two that differ only in case), JSON that
// is not RFC 8259 (invalid UTF-8 included), a payload over [Config.MaxSize].
// A UTF-8 byte order mark is accepted. Decode never panics on input.
//
// # Other languages
//
// [Contract.JSONSchema] writes the contract as a JSON Schema document, from
// the struct and its validate tags, for services in other languages;
// docs/contracts.md shows how a test keeps a checked-in copy current.
//
// # Versions
//
// Unknown fields are ignored, so a reader keeps reading a version whose
// producer added optional fields. A change that an older reader or an older
// payload cannot survive (a new required field, a renamed or retyped field)
// is a new version, "order.confirmed.v2", and [Upcast] turns the older
// events into it, so one handler reads one type while both versions are on
// the topic. middleware/idemtest's RequireCompatible checks this in a test
// against golden payloads; docs/contracts.md shows the whole routine.
package contract
