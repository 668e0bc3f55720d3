package publisher

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

func TestPayloadEventIDScan(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7())
	s := id.String()
	big := strings.Repeat("x", 1<<20)
	cases := []struct {
		name    string
		payload string
		found   bool
		err     error // a sentinel when refused
	}{
		{"top-level field", `{"amount":1,"eventId":"` + s + `"}`, true, nil},
		{"upper case value", `{"eventId":"` + strings.ToUpper(s) + `"}`, true, nil},
		{"after a large member", `{"blob":"` + big + `","nested":{"a":[1,{"b":2}]},"eventId":"` + s + `"}`, true, nil},
		{"key spelled with escapes", `{"\u0065ventId":"` + s + `"}`, true, nil},
		{"value spelled with escapes", `{"eventId":"` + fmt.Sprintf(`\u%04x`, s[0]) + s[1:] + `"}`, true, nil},
		{"surrounding whitespace", " \n{ \"eventId\" : \"" + s + "\" }\t\n", true, nil},
		{"after tricky members", `{"a":"}\"{[","b":[1,"]",{"c":"\\"},[]],"n":-1.5e10,"t":true,"z":null,"eventId":"` + s + `"}`, true, nil},
		{"after an escaped key", `{"\"eventId\"":1,"eventId":"` + s + `"}`, true, nil},
		{"after a UTF-8 BOM", "\xef\xbb\xbf{\"eventId\":\"" + s + "\"}", true, nil},
		{"after a UTF-8 BOM and whitespace", "\xef\xbb\xbf \n{\"eventId\":\"" + s + "\"}", true, nil},

		{"empty payload", ``, false, nil},
		{"not JSON", `amount=1 eventId=` + s, false, nil},
		{"binary", "\xff\xfe\x00\"eventId\"", false, nil},
		{"BOM after whitespace", " \xef\xbb\xbf{\"eventId\":\"" + s + "\"}", false, nil},
		{"two BOMs", "\xef\xbb\xbf\xef\xbb\xbf{\"eventId\":\"" + s + "\"}", false, nil},
		{"JSON array", `[{"eventId":"` + s + `"}]`, false, nil},
		{"JSON string", `"eventId"`, false, nil},
		{"nested deeper", `{"order":{"eventId":"` + s + `"}}`, false, nil},
		{"nested in an array", `{"items":[{"eventId":"` + s + `"}]}`, false, nil},
		{"inside a string value", `{"note":"\"eventId\":\"` + s + `\""}`, false, nil},
		{"other case is another key", `{"EventId":"` + s + `","eventid":"` + s + `"}`, false, nil},
		{"null", `{"eventId":null}`, false, nil},
		{"empty string", `{"eventId":""}`, false, nil},
		{"truncated JSON", `{"eventId":"` + s + `"`, false, nil},
		{"trailing data", `{"eventId":"` + s + `"} x`, false, nil},
		{"two objects", `{"eventId":"` + s + `"}{}`, false, nil},
		{"syntax error after the field", `{"eventId":"` + s + `",}`, false, nil},

		{"number", `{"eventId":42}`, false, ErrInvalidEventID},
		{"object", `{"eventId":{"id":"` + s + `"}}`, false, ErrInvalidEventID},
		{"not canonical", `{"eventId":"{` + s + `}"}`, false, ErrInvalidEventID},
		{"garbage", `{"eventId":"nope"}`, false, ErrInvalidEventID},
		{"twice, same value", `{"eventId":"` + s + `","eventId":"` + s + `"}`, false, ErrInvalidEventID},
		{"twice, escaped", `{"eventId":"` + s + `","\u0065ventId":"` + uuid.Must(uuid.NewV7()).String() + `"}`, false, ErrInvalidEventID},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, found, err := payloadID([]byte(tc.payload))
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
				_, perr := eventIDFromPayload([]byte(tc.payload))
				require.Equal(t, err, perr)
				var e *EventIDError
				require.ErrorAs(t, err, &e)
				require.Equal(t, "payload", e.Source)
				require.False(t, found)
				require.Equal(t, uuid.Nil, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.found, found)
			// The exported form: no id is ErrMissingEventID.
			pid, perr := eventIDFromPayload([]byte(tc.payload))
			if tc.found {
				require.Equal(t, id, got)
				require.NoError(t, perr)
				require.Equal(t, id, pid)
			} else {
				require.Equal(t, uuid.Nil, got)
				require.ErrorIs(t, perr, ErrMissingEventID)
				require.Equal(t, uuid.Nil, pid)
			}
		})
	}
}

// The header and the payload must agree; header-first reads the payload
// only when there is no header.
func TestEventIDFromMessage_HeaderAndPayload(t *testing.T) {
	t.Parallel()
	x, y := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	msg := func(header string, payload string) *message.Message {
		m := message.NewMessage("m", []byte(payload))
		m.Metadata.Set(MetadataEventID, header)
		return m
	}
	payloadOf := func(id string) string { return `{"amount":1,"eventId":"` + id + `"}` }

	for name, m := range map[string]*message.Message{
		"same id":                 msg(x.String(), payloadOf(x.String())),
		"same id, other case":     msg(strings.ToUpper(x.String()), payloadOf(x.String())),
		"no payload id":           msg(x.String(), `{"amount":1}`),
		"payload id nested":       msg(x.String(), `{"order":{"eventId":"`+y.String()+`"}}`),
		"payload not JSON":        msg(x.String(), "amount=1"),
		"payload eventId is null": msg(x.String(), `{"eventId":null}`),
	} {
		got, err := EventIDFromMessage(m)
		require.NoError(t, err, name)
		require.Equal(t, x, got, name)
	}

	// Different ids: refused, typed, naming both.
	m := msg(x.String(), payloadOf(y.String()))
	_, err := EventIDFromMessage(m)
	require.ErrorIs(t, err, ErrEventIDMismatch)
	var e *EventIDError
	require.ErrorAs(t, err, &e)
	require.Equal(t, "payload", e.Source)
	require.Equal(t, y.String(), e.Value)
	require.Contains(t, err.Error(), x.String())
	require.Equal(t, 1, strings.Count(err.Error(), ErrEventIDMismatch.Error()), "the reason is stated once: %s", err)
	// Header first: the header wins, no check.
	got, err := metadataFirst(m)
	require.NoError(t, err)
	require.Equal(t, x, got)

	// A payload eventId that cannot be compared is refused by default,
	// ignored by header first.
	m = msg(x.String(), `{"eventId":42}`)
	_, err = EventIDFromMessage(m)
	require.ErrorIs(t, err, ErrInvalidEventID)
	require.ErrorAs(t, err, &e)
	require.Equal(t, "payload", e.Source)
	got, err = metadataFirst(m)
	require.NoError(t, err)
	require.Equal(t, x, got)

	// A bad header is refused by both, whatever the payload says.
	for _, f := range []func(*message.Message) (uuid.UUID, error){EventIDFromMessage, metadataFirst} {
		_, err := f(msg("nope", payloadOf(x.String())))
		require.ErrorIs(t, err, ErrInvalidEventID)
		_, err = f(msg("", payloadOf(x.String())))
		require.ErrorIs(t, err, ErrMissingEventID)
	}

	// No header: both read the payload.
	for _, f := range []func(*message.Message) (uuid.UUID, error){EventIDFromMessage, metadataFirst} {
		m := message.NewMessage("m", []byte(payloadOf(y.String())))
		got, err := f(m)
		require.NoError(t, err)
		require.Equal(t, y, got)
	}
}

// FuzzPayloadEventID checks the top-level scan against encoding/json decoding the
// whole payload into a map (exact keys, top level only).
func FuzzPayloadEventID(f *testing.F) {
	v7 := uuid.Must(uuid.NewV7()).String()
	for _, seed := range []string{
		`{"eventId":"` + v7 + `"}`,
		`{"a":{"eventId":"` + v7 + `"},"eventId":"` + v7 + `"}`,
		`{"\u0065ventId":"` + v7 + `"}`,
		`{"EventID":"` + v7 + `"}`,
		`{"eventId":"` + v7 + `","eventId":null}`,
		`{"eventId":"` + v7 + `"} {}`,
		`{"eventId":"` + v7 + `"`,
		`[{"eventId":"` + v7 + `"}]`,
		`{"a":"}\"{[","b":[1,"]",{"c":"\\"},[]],"n":-1.5e10,"t":true,"eventId":"` + v7 + `"}`,
		`{"\"eventId\"":1,"x":{"eventId":2}}`,
		`{"eventId":null}`, `{"eventId":""}`, `{"eventId":7}`, `"eventId"`, `{}`, ``, "\xff",
		"\xef\xbb\xbf{\"eventId\":\"" + v7 + "\"}", "\xef\xbb\xbf\xef\xbb\xbf{}",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		id, found, err := payloadID(payload)
		var top map[string]json.RawMessage
		// A leading UTF-8 BOM is skipped (RFC 8259 §8.1), as by the scan.
		if json.Unmarshal(bytes.TrimPrefix(payload, []byte("\xef\xbb\xbf")), &top) != nil || top == nil {
			require.NoError(t, err, "not a JSON object: no payload id, no error")
			require.False(t, found)
			return
		}
		raw, ok := top[PayloadEventIDField]
		if !ok {
			require.NoError(t, err)
			require.False(t, found)
			return
		}
		if err != nil {
			var e *EventIDError
			require.ErrorAs(t, err, &e)
			require.ErrorIs(t, err, ErrInvalidEventID)
			require.False(t, found)
			return
		}
		var s string
		if bytes.Equal(raw, []byte("null")) || (json.Unmarshal(raw, &s) == nil && s == "") {
			require.False(t, found)
			return
		}
		require.NoError(t, json.Unmarshal(raw, &s))
		want, perr := parseCanonical(s)
		require.NoError(t, perr)
		require.True(t, found)
		require.Equal(t, want, id)
	})
}

// payloadID is payloadEventID with the state reduced to found.
func payloadID(payload []byte) (uuid.UUID, bool, error) {
	id, st, err := payloadEventID(payload)
	return id, err == nil && st == payloadFound, err
}
