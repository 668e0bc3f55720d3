package contract

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-playground/validator/v10"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// metadataEventType is the metadata key (a Kafka header) that carries the
// event type, named like publisher's event_id and partition_key.
const metadataEventType = "event_type"

// defaultMaxSize is Config.MaxSize's default: 1 MiB, Kafka's default
// message.max.bytes.
const defaultMaxSize = 1 << 20

// Config declares one version of an event.
type Config struct {
	// Type is the event's name and major version, "<name>.v<N>", such as
	// "order.confirmed.v1". The name is lower case letters, digits, dots,
	// '_' and '-'; N ≥ 1. Required.
	Type string
	// AggregateIDField is the top-level JSON field of the event that holds
	// its aggregate id, such as "orderId". [Contract.Message] copies its
	// value into the partition_key metadata (the Kafka record key), so all
	// events of one aggregate go to one partition, in order, and refuses an
	// event where it is empty. Defaults to none: no partition key.
	AggregateIDField string
	// MaxSize is the largest payload, in bytes, that [Contract.Decode]
	// reads; a larger one is refused (rule max_size) before it is parsed.
	// Defaults to 1 MiB.
	MaxSize int
}

// Contract is one version of an event type and the Go struct T that carries
// it: the consumer's [Contract.Decode] and the producer's
// [Contract.Message]. A Contract is safe for concurrent use once declared
// (after [New] and any [Upcast]).
type Contract[T any] struct {
	cfg     Config
	name    string
	version int
	// from reads an older version of the same event, through an upcaster.
	from map[int]func(payload []byte) (T, error)
}

// New declares the contract of the event cfg.Type carried by struct T. Its
// fields are checked with go-playground/validator struct tags (`validate:"..."`),
// named by their `json` names in errors. Besides validator's own tags,
// "decimal" accepts a decimal string ("129.90", "-3", not "1e3" or ".5"),
// "decimal=N" one with at most N fraction digits, and "positive" a decimal
// string above zero: declare money as a decimal string with them, or as an
// integer of minor units, never as a float.
//
// New refuses a malformed cfg, a T that is not a struct, an
// AggregateIDField that is not one of T's top-level JSON fields, and
// validate tags the validator does not know.
func New[T any](cfg Config) (*Contract[T], error) {
	if cfg.MaxSize == 0 {
		cfg.MaxSize = defaultMaxSize
	}
	name, version, ok := parseType(cfg.Type)
	if !ok {
		return nil, fmt.Errorf("invalid config: Type %q: want <name>.v<N>, such as order.confirmed.v1", cfg.Type)
	}
	if cfg.MaxSize < 0 {
		return nil, fmt.Errorf("invalid config: MaxSize %d is negative", cfg.MaxSize)
	}
	t := reflect.TypeFor[T]()
	if t.Kind() != reflect.Struct {
		return nil, fmt.Errorf("contract %s: %s is not a struct", cfg.Type, t)
	}
	if f := cfg.AggregateIDField; f != "" && !slices.Contains(topLevelFields(t), f) {
		return nil, fmt.Errorf("invalid config: AggregateIDField %q is not a top-level JSON field of %s", f, t)
	}
	c := &Contract[T]{cfg: cfg, name: name, version: version, from: map[int]func([]byte) (T, error){}}
	var zero T
	if err := c.check(&zero); err != nil && !errors.As(err, new(*Error)) {
		return nil, err // a validate tag the validator does not know
	}
	return c, nil
}

// Type returns the event type the contract declares, such as
// "order.confirmed.v2".
func (c *Contract[T]) Type() string { return c.cfg.Type }

// Decode reads msg as an event of this contract, or of an older version it
// has an [Upcast] from, and returns it as a T. It refuses, with an *[Error]
// naming the field and the rule:
//   - a payload over MaxSize (rule max_size);
//   - a payload that is not one JSON object, or has a duplicate key at any
//     depth (rule json, duplicate_key): encoding/json would silently keep
//     the last one;
//   - an event of another type, no event type at all, or a payload
//     eventType that disagrees with the event_type metadata (event_type),
//     and a version this contract cannot read (version);
//   - a JSON value of the wrong type (type), including a JSON number
//     where the struct declares a string, such as a decimal amount;
//   - a field that breaks a validate tag: the tag is the rule (a missing or
//     null required field breaks "required").
//
// The event type is read from the event_type metadata and from the
// payload's top-level eventType field; either is enough, and when both are
// present they must agree. A UTF-8 byte order mark before the JSON is
// skipped. Fields T does not declare are ignored, so a reader keeps working
// when a newer producer adds fields.
func (c *Contract[T]) Decode(msg *message.Message) (T, error) {
	var zero T
	payload := msg.Payload
	if len(payload) > c.cfg.MaxSize {
		return zero, &Error{Type: c.cfg.Type, Rule: "max_size", Param: strconv.Itoa(c.cfg.MaxSize),
			Detail: "the payload has " + strconv.Itoa(len(payload)) + " bytes"}
	}
	payload = bytes.TrimPrefix(payload, []byte("\xef\xbb\xbf"))
	sc, p := scan(payload)
	if p != nil {
		return zero, &Error{Type: c.cfg.Type, Field: p.field, Rule: p.rule, Detail: p.detail}
	}
	read, err := c.reader(msg.Metadata.Get(metadataEventType), sc)
	if err != nil {
		return zero, err
	}
	return read(payload)
}

// reader picks how to read a payload of the event type that the metadata
// and the payload name.
func (c *Contract[T]) reader(meta string, sc scanned) (func([]byte) (T, error), error) {
	typ := meta
	switch {
	case meta != "" && sc.hasEventType && sc.eventType != meta:
		return nil, &Error{Type: c.cfg.Type, Field: payloadTypeField, Rule: "event_type", Param: truncate(sc.eventType),
			Detail: "the payload's eventType disagrees with the event_type metadata " + strconv.Quote(truncate(meta))}
	case meta == "" && sc.hasEventType:
		typ = sc.eventType
	case meta == "":
		return nil, &Error{Type: c.cfg.Type, Field: payloadTypeField, Rule: "event_type",
			Detail: "no event type: neither the event_type metadata nor a payload eventType"}
	}
	name, version, ok := parseType(typ)
	if !ok || name != c.name {
		return nil, &Error{Type: c.cfg.Type, Field: payloadTypeField, Rule: "event_type", Param: truncate(typ),
			Detail: "not an event of this contract"}
	}
	if version == c.version {
		return c.decodeOwn, nil
	}
	if f, ok := c.from[version]; ok {
		return f, nil
	}
	return nil, &Error{Type: c.cfg.Type, Field: payloadTypeField, Rule: "version", Param: typ,
		Detail: "this reader reads " + c.versions()}
}

// decodeOwn reads a payload of the contract's own version.
func (c *Contract[T]) decodeOwn(payload []byte) (T, error) {
	var v T
	if err := json.Unmarshal(payload, &v); err != nil {
		var zero T
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			got, _, _ := strings.Cut(te.Value, " ")
			return zero, &Error{Type: c.cfg.Type, Field: te.Field, Rule: "type",
				Detail: "a JSON " + got + " where the contract declares " + te.Type.String()}
		}
		// A field's own UnmarshalJSON failed (a time.Time that is not RFC
		// 3339, say): encoding/json does not say which field.
		return zero, &Error{Type: c.cfg.Type, Rule: "type", Detail: truncate(err.Error())}
	}
	if err := c.check(&v); err != nil {
		var zero T
		return zero, err
	}
	return v, nil
}

// check runs the validate tags on v. A validator panic (an unknown tag
// inside a nested struct) is returned as a plain error, not a permanent
// one: the contract, not the message, is wrong.
func (c *Contract[T]) check(v *T) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("contract %s: validator: %v", c.cfg.Type, r)
		}
	}()
	err = validate().Struct(v)
	var ve validator.ValidationErrors
	if !errors.As(err, &ve) || len(ve) == 0 {
		return err
	}
	fe := ve[0]
	e := &Error{Type: c.cfg.Type, Field: fieldPath(fe.Namespace()), Rule: fe.Tag(), Param: fe.Param()}
	if len(ve) > 1 {
		e.Detail = "and " + strconv.Itoa(len(ve)-1) + " more"
	}
	return e
}

// Message builds the message that publishes event, ready for any Watermill
// publisher: the outbox's (Outbox.Publisher, PublisherFromContext), or one
// wrapped by publisher.NewStampingPublisher. Its payload is event's JSON
// with an eventId (event's own, or a new UUIDv7 when empty) and eventType
// (the contract's; another one is refused). Its metadata carries the same
// event_id, event_type, partition_key (the value of AggregateIDField) and
// the rest of publisher.Stamp's metadata, stamped in ctx: inside a dedup
// handler the causation and correlation ids come from the handled event.
// msg.UUID is the event id.
//
// Message refuses what Decode would refuse: an event that breaks the
// contract is an *[Error] before it reaches a topic.
func (c *Contract[T]) Message(ctx context.Context, event T) (*message.Message, error) {
	b, err := json.Marshal(event)
	if err != nil {
		return nil, fmt.Errorf("contract %s: %w", c.cfg.Type, err)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(b, &obj); err != nil || obj == nil {
		return nil, fmt.Errorf("contract %s: the event's JSON is not an object", c.cfg.Type)
	}
	if emptyJSON(obj[publisher.PayloadEventIDField]) {
		obj[publisher.PayloadEventIDField] = strconv.AppendQuote(nil, publisher.NewEventID().String())
	}
	switch raw := obj[payloadTypeField]; {
	case emptyJSON(raw):
		obj[payloadTypeField] = strconv.AppendQuote(nil, c.cfg.Type)
	case string(raw) != strconv.Quote(c.cfg.Type):
		return nil, &Error{Type: c.cfg.Type, Field: payloadTypeField, Rule: "event_type",
			Detail: "the event's eventType is not its contract's"}
	}
	if b, err = json.Marshal(obj); err != nil {
		return nil, fmt.Errorf("contract %s: %w", c.cfg.Type, err)
	}
	msg := message.NewMessage("", b)
	msg.SetContext(ctx)
	msg.Metadata.Set(metadataEventType, c.cfg.Type)
	if f := c.cfg.AggregateIDField; f != "" {
		key := aggregateID(obj[f])
		if key == "" {
			return nil, &Error{Type: c.cfg.Type, Field: f, Rule: "required",
				Detail: "the aggregate id is the partition key"}
		}
		publisher.WithPartitionKey(msg, key)
	}
	if _, err := publisher.Stamp(ctx, msg); err != nil {
		return nil, err
	}
	if _, err := c.Decode(msg); err != nil {
		return nil, err
	}
	return msg, nil
}

// versions lists the versions the contract reads: "v1, v2".
func (c *Contract[T]) versions() string {
	vs := []int{c.version}
	for v := range c.from {
		vs = append(vs, v)
	}
	slices.Sort(vs)
	var b strings.Builder
	for i, v := range vs {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("v" + strconv.Itoa(v))
	}
	return b.String()
}

// parseType splits "order.confirmed.v2" into "order.confirmed" and 2.
func parseType(typ string) (name string, version int, ok bool) {
	i := strings.LastIndex(typ, ".v")
	if i <= 0 {
		return "", 0, false
	}
	name, num := typ[:i], typ[i+2:]
	if num == "" || num[0] == '0' || len(num) > 9 || strings.Trim(num, "0123456789") != "" {
		return "", 0, false
	}
	for _, r := range name {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '.' && r != '_' && r != '-' {
			return "", 0, false
		}
	}
	version, _ = strconv.Atoi(num)
	return name, version, true
}

// fieldPath turns validator's "OrderConfirmed.items[2].sku" into
// "items[2].sku", without the names of embedded structs.
func fieldPath(namespace string) string {
	_, rest, ok := strings.Cut(namespace, ".")
	if !ok {
		return namespace
	}
	if !strings.Contains(rest, embeddedMark) {
		return rest
	}
	parts := strings.Split(rest, ".")
	parts = slices.DeleteFunc(parts, func(p string) bool { return p == embeddedMark })
	return strings.Join(parts, ".")
}

// topLevelFields lists the JSON names of struct t's fields.
func topLevelFields(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		if n := jsonName(f); n != "" {
			names = append(names, n)
		}
	}
	return names
}

// jsonName is the name encoding/json gives field f, "" when it skips it.
func jsonName(f reflect.StructField) string {
	tag := f.Tag.Get("json")
	if tag == "-" {
		return ""
	}
	name, _, _ := strings.Cut(tag, ",")
	if name == "" {
		return f.Name
	}
	return name
}

// emptyJSON: absent, null or "".
func emptyJSON(raw json.RawMessage) bool {
	s := string(raw)
	return s == "" || s == "null" || s == `""`
}

// aggregateID reads a JSON string or number as a partition key.
func aggregateID(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var n json.Number
	if json.Unmarshal(raw, &n) == nil {
		return n.String()
	}
	return ""
}

// truncate cuts an untrusted value to 64 bytes for an error text.
func truncate(s string) string {
	if len(s) <= 64 {
		return s
	}
	return strings.ToValidUTF8(s[:64], "") + "…"
}
