package contract

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strconv"
	"strings"
)

// payloadTypeField is the top-level JSON field that may carry the event type
// in the payload, as the seed's events do ("eventType": "order.confirmed.v1").
const payloadTypeField = "eventType"

// scanned is what one pass over the payload's tokens learned.
type scanned struct {
	eventType    string // the top-level eventType string, if any
	hasEventType bool
}

// pathElem is one step of a JSON path: an object key, or an array index
// when key is empty and index ≥ 0.
type pathElem struct {
	key   string
	index int
}

// scanner walks a payload's token stream once: it checks that the payload
// is one JSON object, refuses duplicate keys at every depth (encoding/json
// silently keeps the last one, so two producers' readings of the same bytes
// could differ), and picks up the top-level eventType.
type scanner struct {
	dec  *json.Decoder
	path []pathElem
	out  scanned
}

// problem is a scan failure before it gets the contract's type.
type problem struct {
	field, rule, detail string
}

func scan(payload []byte) (scanned, *problem) {
	s := scanner{dec: json.NewDecoder(bytes.NewReader(payload))}
	s.dec.UseNumber()
	tok, err := s.dec.Token()
	if err != nil {
		return s.out, jsonProblem(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return s.out, &problem{rule: "json", detail: "the payload is not a JSON object"}
	}
	if p := s.object(true); p != nil {
		return s.out, p
	}
	if _, err := s.dec.Token(); err != io.EOF {
		return s.out, &problem{rule: "json", detail: "data after the JSON object"}
	}
	return s.out, nil
}

func jsonProblem(err error) *problem {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &problem{rule: "json", detail: "unexpected end of JSON input"}
	}
	return &problem{rule: "json", detail: err.Error()}
}

// object scans the members of an object whose '{' was read.
func (s *scanner) object(top bool) *problem {
	var keys []string // usually few: a linear search beats a map
	for s.dec.More() {
		tok, err := s.dec.Token()
		if err != nil {
			return jsonProblem(err)
		}
		key, _ := tok.(string)
		for _, k := range keys {
			// encoding/json matches field names without case: "Currency"
			// after "currency" would overwrite it as well.
			if strings.EqualFold(k, key) {
				s.path = append(s.path, pathElem{key: key, index: -1})
				return &problem{field: s.pathString(), rule: "duplicate_key",
					detail: "the key appears more than once in its object (encoding/json would keep the last)"}
			}
		}
		keys = append(keys, key)
		s.path = append(s.path, pathElem{key: key, index: -1})
		tok, err = s.dec.Token()
		if err != nil {
			return jsonProblem(err)
		}
		if top && key == payloadTypeField {
			if v, ok := tok.(string); ok {
				s.out.eventType, s.out.hasEventType = v, true
			}
		}
		if p := s.value(tok); p != nil {
			return p
		}
		s.path = s.path[:len(s.path)-1]
	}
	if _, err := s.dec.Token(); err != nil { // '}'
		return jsonProblem(err)
	}
	return nil
}

// value scans the value that starts with tok.
func (s *scanner) value(tok json.Token) *problem {
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '{':
		return s.object(false)
	case '[':
		for i := 0; s.dec.More(); i++ {
			s.path = append(s.path, pathElem{index: i})
			tok, err := s.dec.Token()
			if err != nil {
				return jsonProblem(err)
			}
			if p := s.value(tok); p != nil {
				return p
			}
			s.path = s.path[:len(s.path)-1]
		}
		if _, err := s.dec.Token(); err != nil { // ']'
			return jsonProblem(err)
		}
	}
	return nil
}

func (s *scanner) pathString() string {
	var b strings.Builder
	for _, e := range s.path {
		if e.index >= 0 {
			b.WriteString("[" + strconv.Itoa(e.index) + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.WriteString(e.key)
	}
	return b.String()
}
