package contract_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	jsv "github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/contract"
)

// compileSchema compiles c's JSON Schema with a JSON Schema 2020-12
// validator that asserts formats, as another language's service would.
func compileSchema[T any](t *testing.T, c *contract.Contract[T]) *jsv.Schema {
	t.Helper()
	doc, err := c.JSONSchema()
	require.NoError(t, err)
	parsed, err := jsv.UnmarshalJSON(bytes.NewReader(doc))
	require.NoError(t, err)
	comp := jsv.NewCompiler()
	comp.AssertFormat()
	require.NoError(t, comp.AddResource("mem://"+c.Type()+".json", parsed))
	s, err := comp.Compile("mem://" + c.Type() + ".json")
	require.NoError(t, err)
	return s
}

func schemaValidates(t *testing.T, s *jsv.Schema, payload string) error {
	t.Helper()
	v, err := jsv.UnmarshalJSON(strings.NewReader(payload))
	require.NoError(t, err)
	return s.Validate(v)
}

// The schema agrees with Decode: it accepts what Decode accepts, and
// refuses every bad input Decode refuses that JSON Schema can state
// (duplicate keys and MaxSize it cannot; see JSONSchema's doc).
func TestJSONSchemaAgreesWithDecode(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	s := compileSchema(t, c)

	for name, p := range map[string]string{
		"good":           goodPayload,
		"unknown fields": edit(t, `"currency":"EUR"`, `"currency":"EUR","discount":{"code":"X"},"channel":"web"`),
		"no eventType":   edit(t, `"eventType":"order.confirmed.v1",`, ``),
	} {
		_, decodeErr := c.Decode(msgOf(p, "event_type", "order.confirmed.v1"))
		require.NoError(t, decodeErr, name)
		require.NoError(t, schemaValidates(t, s, p), name)
	}

	for name, p := range map[string]string{
		"missing field":                  edit(t, `"customerId":"c-1",`, ``),
		"null for a required field":      edit(t, `"customerId":"c-1"`, `"customerId":null`),
		"empty required string":          edit(t, `"customerId":"c-1"`, `"customerId":""`),
		"wrong type":                     edit(t, `"orderId":"o-1"`, `"orderId":17`),
		"wrong type in an array":         edit(t, `"quantity":2`, `"quantity":"2"`),
		"out of range number":            edit(t, `"quantity":2`, `"quantity":1001`),
		"zero quantity":                  edit(t, `"quantity":2`, `"quantity":0`),
		"negative minor units":           edit(t, `"priceMinor":6495`, `"priceMinor":-1`),
		"float for minor units":          edit(t, `"priceMinor":6495`, `"priceMinor":64.95`),
		"float where money is a decimal": edit(t, `"totalAmount":"129.90"`, `"totalAmount":129.90`),
		"decimal with too many places":   edit(t, `"totalAmount":"129.90"`, `"totalAmount":"129.901"`),
		"decimal with an exponent":       edit(t, `"totalAmount":"129.90"`, `"totalAmount":"1e3"`),
		"zero amount":                    edit(t, `"totalAmount":"129.90"`, `"totalAmount":"0.00"`),
		"negative amount":                edit(t, `"totalAmount":"129.90"`, `"totalAmount":"-1"`),
		"currency not 3 letters":         edit(t, `"currency":"EUR"`, `"currency":"EURO"`),
		"currency in lower case":         edit(t, `"currency":"EUR"`, `"currency":"eur"`),
		"not a uuid":                     edit(t, `"eventId":"0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f"`, `"eventId":"42"`),
		"not a date-time":                edit(t, `"occurredAt":"2026-01-02T03:04:05Z"`, `"occurredAt":"yesterday"`),
		"no items":                       edit(t, `[{"sku":"A-1","quantity":2,"priceMinor":6495}]`, `[]`),
		"an item without sku":            edit(t, `"sku":"A-1",`, ``),
		"another event type":             edit(t, `"eventType":"order.confirmed.v1"`, `"eventType":"order.shipped.v1"`),
		"another version":                edit(t, `"eventType":"order.confirmed.v1"`, `"eventType":"order.confirmed.v9"`),
		"not an object":                  `[1,2]`,
	} {
		_, decodeErr := c.Decode(msgOf(p))
		require.Error(t, decodeErr, "Decode accepted %s", name)
		require.Error(t, schemaValidates(t, s, p), "the schema accepted %s", name)
	}
}

// The document is stable (a checked-in copy can be compared byte for byte),
// keeps each field's validate tag, and states the rules as keywords.
func TestJSONSchemaDocument(t *testing.T) {
	t.Parallel()
	c := newOrderConfirmed(t)
	a, err := c.JSONSchema()
	require.NoError(t, err)
	b, err := c.JSONSchema()
	require.NoError(t, err)
	require.Equal(t, string(a), string(b))

	var doc struct {
		Schema     string   `json:"$schema"`
		Title      string   `json:"title"`
		Required   []string `json:"required"`
		Properties map[string]struct {
			Type     string `json:"type"`
			Const    string `json:"const"`
			Pattern  string `json:"pattern"`
			Validate string `json:"x-go-validate"`
		} `json:"properties"`
		AdditionalProperties *bool `json:"additionalProperties"`
	}
	require.NoError(t, json.Unmarshal(a, &doc))
	require.Equal(t, "https://json-schema.org/draft/2020-12/schema", doc.Schema)
	require.Equal(t, "order.confirmed.v1", doc.Title)
	require.ElementsMatch(t, []string{"eventId", "occurredAt", "orderId", "customerId", "totalAmount", "currency", "items"}, doc.Required)
	require.Equal(t, "order.confirmed.v1", doc.Properties["eventType"].Const)
	require.Equal(t, "required,iso4217", doc.Properties["currency"].Validate)
	require.Equal(t, "^[A-Z]{3}$", doc.Properties["currency"].Pattern)
	require.Equal(t, "string", doc.Properties["totalAmount"].Type)
	require.Nil(t, doc.AdditionalProperties, "unknown fields stay allowed")
}

// A tag that refuses the zero value makes the field required even without
// "required"; omitempty makes the rules conditional.
func TestJSONSchemaRequiredAndOmitEmpty(t *testing.T) {
	t.Parallel()
	type Event struct {
		Kind  string   `json:"kind" validate:"eq=Order"`
		Note  string   `json:"note,omitempty" validate:"omitempty,min=3"`
		Count int      `json:"count" validate:"omitempty,gt=2"`
		Tags  []string `json:"tags" validate:"dive,oneof=a b"`
	}
	c, err := contract.New[Event](contract.Config{Type: "thing.happened.v1"})
	require.NoError(t, err)
	s := compileSchema(t, c)
	for _, p := range []string{
		`{"kind":"Order"}`,
		`{"kind":"Order","note":"","count":0,"tags":[]}`,
		`{"kind":"Order","note":"abc","count":3,"tags":["a","b"]}`,
	} {
		_, err := c.Decode(msgOf(p, "event_type", "thing.happened.v1"))
		require.NoError(t, err, p)
		require.NoError(t, schemaValidates(t, s, p), p)
	}
	for _, p := range []string{
		`{}`,
		`{"kind":"Other"}`,
		`{"kind":"Order","note":"ab"}`,
		`{"kind":"Order","count":2}`,
		`{"kind":"Order","tags":["c"]}`,
	} {
		_, err := c.Decode(msgOf(p, "event_type", "thing.happened.v1"))
		require.Error(t, err, p)
		require.Error(t, schemaValidates(t, s, p), p)
	}
}
