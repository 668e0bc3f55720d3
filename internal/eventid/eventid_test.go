package eventid_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
)

var sentinels = []error{eventid.ErrMissing, eventid.ErrInvalid, eventid.ErrNil, eventid.ErrNotV7, eventid.ErrMismatch}

// FuzzEventID proves that extraction and validation never panic and always
// end in either a usable id or an *eventid.Error wrapping a sentinel; `go
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
			m.Metadata.Set(eventid.MetadataEventID, header)
		}
		id, err := eventid.FromMessage(m)
		hid, herr := eventid.FromMessageHeaderFirst(m)
		if err == nil {
			// Header first is the lenient reading: it agrees whenever the
			// strict one accepts.
			require.NoError(t, herr)
			require.Equal(t, id, hid)
		}
		if herr != nil {
			require.Error(t, err, "header first refuses only what the strict reading refuses too")
		}
		if err != nil {
			require.Equal(t, uuid.Nil, id)
			var e *eventid.Error
			require.ErrorAs(t, err, &e)
			require.True(t, isSentinel(e.Reason), "reason %v is not a sentinel", e.Reason)
			require.LessOrEqual(t, len(e.Value), 64+len("…"), "offending values are truncated")
			require.NotEmpty(t, e.Error())
			return
		}
		// A parsed id round-trips to the canonical form of its source, and a
		// payload id next to a header names the same UUID.
		src := header
		if pid, found, perr := eventid.PayloadID(payload); hasHeader && perr == nil && found {
			require.Equal(t, id, pid)
		}
		if !hasHeader {
			got, perr := eventid.FromPayload(payload)
			require.NoError(t, perr)
			require.Equal(t, id, got)
			return
		}
		require.Len(t, src, 36)
		require.True(t, strings.EqualFold(id.String(), src))
		if verr := eventid.Validate(id, false); verr != nil {
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
	got, err := eventid.Parse(v7.String())
	require.NoError(t, err)
	require.Equal(t, v7, got)
	got, err = eventid.Parse(strings.ToUpper(v7.String()))
	require.NoError(t, err)
	require.Equal(t, v7, got)
	for _, s := range []string{"", "x", "{" + v7.String() + "}", "urn:uuid:" + v7.String(),
		strings.ReplaceAll(v7.String(), "-", ""), " " + v7.String(), v7.String() + " "} {
		_, err := eventid.Parse(s)
		require.ErrorIs(t, err, eventid.ErrInvalid, "%q", s)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, eventid.Validate(uuid.Must(uuid.NewV7()), false))
	require.ErrorIs(t, eventid.Validate(uuid.Nil, true), eventid.ErrNil)
	require.ErrorIs(t, eventid.Validate(uuid.New(), false), eventid.ErrNotV7)
	require.NoError(t, eventid.Validate(uuid.New(), true))
	// A non-RFC variant (the Microsoft GUID variant bits 110).
	odd := uuid.Must(uuid.NewV7())
	odd[8] = 0xc0 | (odd[8] & 0x1f)
	require.ErrorIs(t, eventid.Validate(odd, true), eventid.ErrInvalid)
}

func TestFromMessageValueIsTruncated(t *testing.T) {
	t.Parallel()
	m := message.NewMessage("m", nil)
	m.Metadata.Set(eventid.MetadataEventID, strings.Repeat("x", 500))
	_, err := eventid.FromMessage(m)
	var e *eventid.Error
	require.ErrorAs(t, err, &e)
	require.ErrorIs(t, err, eventid.ErrInvalid)
	require.Equal(t, "metadata", e.Source)
	require.Less(t, len(e.Value), 100)
}
