package publisher

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

var sentinels = []error{ErrMissingEventID, ErrInvalidEventID, ErrNilEventID, ErrNotUUIDv7, ErrEventIDMismatch}

// FuzzEventID proves that extraction and validation never panic and always
// end in either a usable id or an *EventIDError wrapping a sentinel; `go
// test` runs the seed corpus, `go test -fuzz FuzzEventID` explores further.
func FuzzEventID(f *testing.F) {
	v7 := uuid.Must(uuid.NewV7()).String()
	for _, seed := range []struct {
		header    string
		hasHeader bool
		payload   string
	}{
		{v7, true, ""},
		{strings.ToUpper(v7), true, ""},
		{"", true, `{"eventId":"` + v7 + `"}`},
		{"", false, `{"eventId":"` + v7 + `"}`},
		{"", false, `{"eventId":42}`},
		{"", false, `{"eventId":null}`},
		{"", false, `{"eventId":"` + v7 + `"`},
		{"", false, `[1,2,3]`},
		{"", false, `"just a string"`},
		{"", false, "\xff\xfe\x00"},
		{"{" + v7 + "}", true, ""},
		{"urn:uuid:" + v7, true, ""},
		{strings.ReplaceAll(v7, "-", ""), true, ""},
		{uuid.Nil.String(), true, ""},
		{uuid.New().String(), true, ""},
		{"ffffffff-ffff-ffff-ffff-ffffffffffff", true, ""},
		{"0000000-0000-7000-8000-0000000000000", true, ""},
		{strings.Repeat("a", 1000), true, ""},
		{"", false, `{"eventId":"` + strings.Repeat("é", 40) + `"}`},
		// Header and payload: agreeing, disagreeing, nested, unusable.
		{v7, true, `{"eventId":"` + strings.ToUpper(v7) + `"}`},
		{v7, true, `{"eventId":"` + uuid.Must(uuid.NewV7()).String() + `"}`},
		{v7, true, `{"order":{"eventId":"` + uuid.Must(uuid.NewV7()).String() + `"}}`},
		{v7, true, `{"eventId":42}`},
		{v7, true, `{"eventId":"` + v7 + `","eventId":"` + v7 + `"}`},
		{"", false, `{"\u0065ventId":"` + v7 + `"}`},
	} {
		f.Add(seed.header, seed.hasHeader, []byte(seed.payload))
	}
	f.Fuzz(func(t *testing.T, header string, hasHeader bool, payload []byte) {
		m := message.NewMessage("m", payload)
		if hasHeader {
			m.Metadata.Set(MetadataEventID, header)
		}
		id, err := EventIDFromMessage(m)
		hid, herr := metadataFirst(m)
		if err == nil {
			// Header first is the lenient reading: it agrees whenever the
			// strict one accepts.
			require.NoError(t, herr)
			require.Equal(t, id, hid)
		}
		if herr != nil {
			require.Error(t, err, "header first refuses only what the strict reading refuses too")
		}
		if mid, merr := metadataOnly(m); hasHeader {
			// With a header, metadata only and header first are one reading.
			require.Equal(t, herr, merr)
			require.Equal(t, hid, mid)
		} else {
			require.ErrorIs(t, merr, ErrMissingEventID)
		}
		if err != nil {
			require.Equal(t, uuid.Nil, id)
			var e *EventIDError
			require.ErrorAs(t, err, &e)
			require.True(t, isSentinel(e.Reason), "reason %v is not a sentinel", e.Reason)
			require.LessOrEqual(t, len(e.Value), 64+len("…"), "offending values are truncated")
			require.NotEmpty(t, e.Error())
			return
		}
		// A parsed id round-trips to the canonical form of its source, and a
		// payload id next to a header names the same UUID.
		src := header
		if pid, found, perr := payloadID(payload); hasHeader && perr == nil && found {
			require.Equal(t, id, pid)
		}
		if !hasHeader {
			got, perr := eventIDFromPayload(payload)
			require.NoError(t, perr)
			require.Equal(t, id, got)
			return
		}
		require.Len(t, src, 36)
		require.True(t, strings.EqualFold(id.String(), src))
		if verr := ValidateEventID(id, false); verr != nil {
			require.True(t, isSentinel(verr))
		}
	})
}

func isSentinel(err error) bool {
	for _, s := range sentinels {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

func TestParseIsStrict(t *testing.T) {
	t.Parallel()
	v7 := uuid.Must(uuid.NewV7())
	got, err := parseCanonical(v7.String())
	require.NoError(t, err)
	require.Equal(t, v7, got)
	got, err = parseCanonical(strings.ToUpper(v7.String()))
	require.NoError(t, err)
	require.Equal(t, v7, got)
	for _, s := range []string{"", "x", "{" + v7.String() + "}", "urn:uuid:" + v7.String(),
		strings.ReplaceAll(v7.String(), "-", ""), " " + v7.String(), v7.String() + " "} {
		_, err := parseCanonical(s)
		require.ErrorIs(t, err, ErrInvalidEventID, "%q", s)
	}
}

func TestValidateEventID(t *testing.T) {
	t.Parallel()
	require.NoError(t, ValidateEventID(uuid.Must(uuid.NewV7()), false))
	require.ErrorIs(t, ValidateEventID(uuid.Nil, true), ErrNilEventID)
	v4 := uuid.New()
	err := ValidateEventID(v4, false)
	require.ErrorIs(t, err, ErrNotUUIDv7)
	var e *EventIDError
	require.ErrorAs(t, err, &e)
	require.Equal(t, v4.String(), e.Value)
	require.NoError(t, ValidateEventID(v4, true))
	// A non-RFC variant (the Microsoft GUID variant bits 110).
	odd := uuid.Must(uuid.NewV7())
	odd[8] = 0xc0 | (odd[8] & 0x1f)
	require.ErrorIs(t, ValidateEventID(odd, true), ErrInvalidEventID)
}

// Every constructor cuts the offending value when it builds the error, at a
// rune boundary, so neither the struct nor its rendering carries an
// unbounded string.
func TestEventIDErrorValueIsTruncated(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 500)
	accents := "x" + strings.Repeat("é", 40) // byte 64 falls inside a rune
	headerMsg := func(v string) *message.Message {
		m := message.NewMessage("m", nil)
		m.Metadata.Set(MetadataEventID, v)
		return m
	}
	for name, f := range map[string]func() error{
		"metadata": func() error { _, err := EventIDFromMessage(headerMsg(long)); return err },
		"payload": func() error {
			_, err := EventIDFromMessage(message.NewMessage("m", []byte(`{"eventId":"`+long+`"}`)))
			return err
		},
		"payload, not a string": func() error {
			_, err := eventIDFromPayload([]byte(`{"eventId":[` + strings.Repeat("1,", 200) + `1]}`))
			return err
		},
		"ParseEventID":         func() error { _, err := ParseEventID(long); return err },
		"Stamp":                func() error { _, err := Stamp(t.Context(), headerMsg(long)); return err },
		"multi-byte runes":     func() error { _, err := ParseEventID(accents); return err },
		"multi-byte, metadata": func() error { _, err := metadataOnly(headerMsg(accents)); return err },
	} {
		err := f()
		var e *EventIDError
		require.ErrorAs(t, err, &e, name)
		require.ErrorIs(t, err, ErrInvalidEventID, name)
		require.LessOrEqual(t, len(e.Value), maxValueLen+len("…"), name)
		require.True(t, strings.HasSuffix(e.Value, "…"), name)
		require.True(t, utf8.ValidString(e.Value), "%s: cut at a rune boundary: %q", name, e.Value)
		require.Less(t, len(err.Error()), 300, name)
	}
	require.Equal(t, "short", truncate("short"))
	require.Equal(t, strings.Repeat("x", maxValueLen), truncate(strings.Repeat("x", maxValueLen)))
}
