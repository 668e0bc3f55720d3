package failures

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	jsv "github.com/santhosh-tekuri/jsonschema/v6"
)

// metadataEventType is the header contract.Contract.Message writes the
// event type to; payloadEventType its payload twin.
const (
	metadataEventType = "event_type"
	payloadEventType  = "eventType"
	payloadEventID    = "eventId"
)

// Contracts are the events' JSON Schemas by event type
// ("order.confirmed.v1").
type Contracts map[string]*jsv.Schema

// LoadContracts compiles every <event type>.json of dir (the files
// contract.Contract.JSONSchema writes, as docs/schemas holds them), with
// formats asserted as another language's validator would.
func LoadContracts(dir string) (Contracts, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	out := Contracts{}
	for _, p := range paths {
		typ := strings.TrimSuffix(filepath.Base(p), ".json")
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("contracts: %w", err)
		}
		s, err := CompileContract(typ, b)
		if err != nil {
			return nil, fmt.Errorf("contracts: %s: %w", p, err)
		}
		out[typ] = s
	}
	return out, nil
}

// CompileContract compiles one event type's JSON Schema document.
func CompileContract(typ string, doc []byte) (*jsv.Schema, error) {
	parsed, err := jsv.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		return nil, err
	}
	comp := jsv.NewCompiler()
	comp.AssertFormat()
	url := "mem://" + typ + ".json"
	if err := comp.AddResource(url, parsed); err != nil {
		return nil, err
	}
	return comp.Compile(url)
}

// ErrInvalidEdit is the reason an edited payload is refused; the error's
// text says which rule it broke.
var ErrInvalidEdit = errors.New("edited payload refused")

// checkEdit refuses an edited payload that is not one JSON object, changes
// or drops the event's id, names another event type, or breaks its type's
// contract. eventID is the record's event id, typ its event_type header.
func (c Contracts) checkEdit(payload []byte, eventID, typ string) error {
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil || dec.More() {
		return fmt.Errorf("%w: not one JSON object", ErrInvalidEdit)
	}
	if id, ok := doc[payloadEventID]; eventID != "" && (!ok || id != eventID) {
		return fmt.Errorf("%w: %s must stay %s (the event's id, which the consumers' claims dedup on)", ErrInvalidEdit, payloadEventID, eventID)
	}
	if t, ok := doc[payloadEventType].(string); ok {
		if typ != "" && t != typ {
			return fmt.Errorf("%w: %s %q differs from the event_type header %q", ErrInvalidEdit, payloadEventType, t, typ)
		}
		typ = t
	}
	if typ == "" {
		return fmt.Errorf("%w: the event has no event type (event_type header or eventType field): no contract to check it with", ErrInvalidEdit)
	}
	s, ok := c[typ]
	if !ok {
		return fmt.Errorf("%w: no contract for event type %q (idemctl serve --contracts DIR with %s.json)", ErrInvalidEdit, typ, typ)
	}
	v, err := jsv.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return fmt.Errorf("%w: %v", ErrInvalidEdit, err)
	}
	if err := s.Validate(v); err != nil {
		return fmt.Errorf("%w: contract %s: %v", ErrInvalidEdit, typ, err)
	}
	return nil
}
