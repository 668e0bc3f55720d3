package publisher_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestNewEventIDIsIncreasingUUIDv7(t *testing.T) {
	t.Parallel()
	prev := publisher.NewEventID()
	for range 10000 {
		id := publisher.NewEventID()
		require.EqualValues(t, 7, id.Version())
		require.Equal(t, uuid.RFC4122, id.Variant())
		require.Equal(t, 1, bytes.Compare(id[:], prev[:]), "ids from one process strictly increase")
		prev = id
	}
}

func TestParseEventID(t *testing.T) {
	t.Parallel()
	id := publisher.NewEventID()
	got, err := publisher.ParseEventID(id.String())
	require.NoError(t, err)
	require.Equal(t, id, got)
	got, err = publisher.ParseEventID(strings.ToUpper(id.String()))
	require.NoError(t, err)
	require.Equal(t, id, got)

	for s, want := range map[string]error{
		"":                                  publisher.ErrInvalidEventID,
		"nope":                              publisher.ErrInvalidEventID,
		"{" + id.String() + "}":             publisher.ErrInvalidEventID,
		"urn:uuid:" + id.String():           publisher.ErrInvalidEventID,
		uuid.Nil.String():                   publisher.ErrNilEventID,
		uuid.NewString():                    publisher.ErrNotUUIDv7,
		uuid.NewMD5(uuid.Nil, nil).String(): publisher.ErrNotUUIDv7,
	} {
		_, err := publisher.ParseEventID(s)
		require.ErrorIs(t, err, want, "%q", s)
		require.True(t, idem.IsPermanent(err))
	}
}
