package contract

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"

	"github.com/go-json-experiment/json/jsontext"
)

// payloadTypeField is the top-level JSON field that may carry the event type
// in the payload, as events of producers outside this library often do
// ("eventType": "order.confirmed.v1").
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

// scanner walks a payload once with jsontext's decoder, which refuses
// anything that is not RFC 8259 JSON (invalid UTF-8 included) and
// duplicate names at every depth. On top of that it refuses two names of
// one object that differ only in case (encoding/json matches field names
// without case, so the last of them would silently win), checks that the
// payload is one JSON object, and picks up the top-level eventType. It
// allocates little: names are kept in one buffer, and decoders are reused.
type scanner struct {
	dec   *jsontext.Decoder
	path  []pathElem
	out   scanned
	names []byte       // the names of the objects being read, unquoted, back to back
	ends  []int        // where each of those names ends in names
	tmp   []byte       // scratch for unquoting
	rd    bytes.Buffer // the payload: the decoder reads it in place
}

// problem is a scan failure before it gets the contract's type.
type problem struct {
	field, rule, detail string
}

var scanners = sync.Pool{New: func() any {
	s := &scanner{}
	s.dec = jsontext.NewDecoder(&s.rd)
	return s
}}

func scan(payload []byte) (scanned, *problem) {
	s := scanners.Get().(*scanner)
	defer func() {
		s.rd = bytes.Buffer{} // keep no payload alive in the pool
		s.dec.Reset(&s.rd)
		s.path, s.names, s.ends, s.out = s.path[:0], s.names[:0], s.ends[:0], scanned{}
		scanners.Put(s)
	}()
	s.rd = *bytes.NewBuffer(payload)
	s.dec.Reset(&s.rd)
	if k := s.dec.PeekKind(); k != '{' {
		if k == 0 { // an error: empty, or not JSON
			_, err := s.dec.ReadToken()
			return scanned{}, s.jsonProblem(err)
		}
		return scanned{}, &problem{rule: "json", detail: "the payload is not a JSON object"}
	}
	if p := s.object(true); p != nil {
		return scanned{}, p
	}
	if _, err := s.dec.ReadToken(); err != io.EOF {
		return scanned{}, &problem{rule: "json", detail: "data after the JSON object"}
	}
	return s.out, nil
}

// jsonProblem describes a decoder error: a duplicate name with its path,
// anything else as malformed JSON.
func (s *scanner) jsonProblem(err error) *problem {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &problem{rule: "json", detail: "unexpected end of JSON input"}
	}
	var se *jsontext.SyntacticError
	if errors.As(err, &se) && errors.Is(se.Err, jsontext.ErrDuplicateName) {
		return &problem{field: pointerPath(string(se.JSONPointer)), rule: "duplicate_key",
			detail: "the key appears more than once in its object (encoding/json would keep the last)"}
	}
	if se != nil {
		return &problem{rule: "json", detail: truncate(se.Err.Error()) + " at byte " + strconv.FormatInt(se.ByteOffset, 10)}
	}
	return &problem{rule: "json", detail: truncate(err.Error())}
}

// object reads an object, from its '{'.
func (s *scanner) object(top bool) *problem {
	if _, err := s.dec.ReadToken(); err != nil {
		return s.jsonProblem(err)
	}
	first := len(s.ends) // this object's names are ends[first:]
	defer func() {
		s.ends = s.ends[:first]
		if first == 0 {
			s.names = s.names[:0]
		} else {
			s.names = s.names[:s.ends[first-1]]
		}
	}()
	for s.dec.PeekKind() == '"' {
		raw, err := s.dec.ReadValue()
		if err != nil {
			return s.jsonProblem(err)
		}
		name := raw[1 : len(raw)-1]
		if bytes.IndexByte(name, '\\') >= 0 {
			if s.tmp, err = jsontext.AppendUnquote(s.tmp[:0], raw); err != nil {
				return s.jsonProblem(err)
			}
			name = s.tmp
		}
		start := 0
		if first > 0 {
			start = s.ends[first-1]
		}
		for _, end := range s.ends[first:] {
			// Exact duplicates the decoder refused already; these differ
			// in case only.
			if bytes.EqualFold(s.names[start:end], name) {
				s.path = append(s.path, pathElem{key: string(name), index: -1})
				return &problem{field: s.pathString(), rule: "duplicate_key",
					detail: "the key appears more than once in its object, in another case (encoding/json would keep the last)"}
			}
			start = end
		}
		s.names = append(s.names, name...)
		s.ends = append(s.ends, len(s.names))
		s.path = append(s.path, pathElem{key: string(name), index: -1})
		if top && string(name) == payloadTypeField && s.dec.PeekKind() == '"' {
			v, err := s.dec.ReadToken()
			if err != nil {
				return s.jsonProblem(err)
			}
			s.out.eventType, s.out.hasEventType = v.String(), true
		} else if p := s.value(); p != nil {
			return p
		}
		s.path = s.path[:len(s.path)-1]
	}
	if _, err := s.dec.ReadToken(); err != nil { // '}', or what stands there instead
		return s.jsonProblem(err)
	}
	return nil
}

// value reads the next value.
func (s *scanner) value() *problem {
	switch s.dec.PeekKind() {
	case '{':
		return s.object(false)
	case '[':
		if _, err := s.dec.ReadToken(); err != nil {
			return s.jsonProblem(err)
		}
		for i := 0; s.dec.PeekKind() != ']'; i++ {
			if s.dec.PeekKind() == 0 {
				_, err := s.dec.ReadToken()
				return s.jsonProblem(err)
			}
			s.path = append(s.path, pathElem{index: i})
			if p := s.value(); p != nil {
				return p
			}
			s.path = s.path[:len(s.path)-1]
		}
		if _, err := s.dec.ReadToken(); err != nil {
			return s.jsonProblem(err)
		}
		return nil
	}
	if err := s.dec.SkipValue(); err != nil {
		return s.jsonProblem(err)
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

// pointerPath turns a JSON Pointer ("/items/0/sku") into the path of the
// contract's errors ("items[0].sku"). A number is taken as an index.
func pointerPath(ptr string) string {
	var b strings.Builder
	for seg := range strings.SplitSeq(strings.TrimPrefix(ptr, "/"), "/") {
		if ptr == "" {
			break
		}
		seg = strings.ReplaceAll(strings.ReplaceAll(seg, "~1", "/"), "~0", "~")
		if _, err := strconv.Atoi(seg); err == nil && seg != "" {
			b.WriteString("[" + seg + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.WriteString(seg)
	}
	return b.String()
}
