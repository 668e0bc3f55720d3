package outboxsql

import (
	"bytes"
	"encoding/json"
	"slices"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// decodeMetadata decodes a row's metadata JSON object. Metadata written by
// watermill-sql is the compact json.Marshal form of a map[string]string;
// without escapes it is decoded by a fast path (decoding dominated the
// forwarder's read time), anything else by encoding/json.
func decodeMetadata(b []byte) (message.Metadata, error) {
	if md, ok := decodeFlat(b); ok {
		return md, nil
	}
	md := message.Metadata{}
	if err := json.Unmarshal(b, &md); err != nil {
		return nil, err
	}
	if md == nil { // JSON null
		md = message.Metadata{}
	}
	return md, nil
}

// decodeFlat decodes {"k":"v",...} with no whitespace and no backslash.
// It reports false for anything else, including valid JSON it does not
// handle, so the caller falls back to encoding/json.
func decodeFlat(b []byte) (message.Metadata, bool) {
	md := make(message.Metadata, 8)
	if !FlatPairs(b, func(k, v []byte) { md[string(k)] = string(v) }) {
		return nil, false
	}
	return md, true
}

// FlatPairs calls yield with each key and value of b, a JSON object of
// strings in the compact form json.Marshal gives a map[string]string
// without escapes ({"k":"v",...}: no whitespace, no backslash, no control
// character, valid UTF-8), as sub-slices of b. For anything else it
// reports false, possibly after yielding some pairs: the caller then
// decodes b another way.
func FlatPairs(b []byte, yield func(k, v []byte)) bool {
	if len(b) < 2 || b[0] != '{' || b[len(b)-1] != '}' || bytes.IndexByte(b, '\\') >= 0 {
		return false
	}
	if len(b) == 2 {
		return true
	}
	i := 1
	for {
		k, n, ok := flatString(b, i)
		if !ok || n >= len(b) || b[n] != ':' {
			return false
		}
		v, n, ok := flatString(b, n+1)
		if !ok || n >= len(b) {
			return false
		}
		yield(k, v)
		switch {
		case b[n] == ',':
			i = n + 1
		case b[n] == '}' && n == len(b)-1:
			return true
		default:
			return false
		}
	}
}

// flatString reads the string starting at b[i] == '"' (no escapes) and
// returns it with the index after its closing quote.
func flatString(b []byte, i int) ([]byte, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, 0, false
	}
	j := bytes.IndexByte(b[i+1:], '"')
	if j < 0 {
		return nil, 0, false
	}
	s := b[i+1 : i+1+j]
	for _, c := range s {
		if c < 0x20 {
			return nil, 0, false
		}
	}
	if !utf8.Valid(s) {
		return nil, 0, false
	}
	return s, i + 2 + j, true
}

// EncodeMetadata encodes md as watermill-sql writes a row's metadata:
// json.Marshal of the map (keys sorted, compact), byte for byte. When every
// key and value is printable ASCII that encoding/json leaves as it is (no
// quote, backslash, <, > or &), it is written directly (marshalling the map
// through reflection was a visible part of each outbox write); anything
// else goes through encoding/json.
func EncodeMetadata(md message.Metadata) ([]byte, error) {
	if md == nil {
		return json.Marshal(md)
	}
	keys := make([]string, 0, len(md))
	size := 2
	for k, v := range md {
		if !plainString(k) || !plainString(v) {
			return json.Marshal(md)
		}
		keys = append(keys, k)
		size += len(k) + len(v) + 6
	}
	slices.Sort(keys)
	b := make([]byte, 0, size)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		b = append(b, k...)
		b = append(b, '"', ':', '"')
		b = append(b, md[k]...)
		b = append(b, '"')
	}
	return append(b, '}'), nil
}

// plainString reports whether encoding/json writes s between quotes as it
// is.
func plainString(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20 || c > 0x7e, c == '"', c == '\\', c == '<', c == '>', c == '&':
			return false
		}
	}
	return true
}
