package publisher_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func payloadWithID(id string) []byte {
	return []byte(`{"orderId":"order-42","eventId":"` + id + `","total":1200}`)
}

// The reference puts eventId in the JSON payload: a UUIDv7 there is the
// event's id, ahead of msg.UUID, and the same payload stamped twice (the
// README way, a fresh watermill.NewUUID() each time) gets one id.
func TestStamp_PayloadEventIDBecomesTheEventID(t *testing.T) {
	t.Parallel()
	x := publisher.NewEventID()
	for name, msgUUID := range map[string]string{
		"msg.UUID a UUIDv4":          watermill.NewUUID(),
		"msg.UUID another UUIDv7":    publisher.NewEventID().String(),
		"msg.UUID not a UUID at all": "order-42",
	} {
		var ids []uuid.UUID
		for range 2 {
			msg := message.NewMessage(msgUUID, payloadWithID(x.String()))
			id, err := publisher.Stamp(context.Background(), msg)
			require.NoError(t, err, name)
			require.Equal(t, x.String(), msg.Metadata.Get(publisher.MetadataEventID), name)
			require.Equal(t, msgUUID, msg.UUID, "%s: msg.UUID is never overwritten", name)
			ids = append(ids, id)
		}
		require.Equal(t, []uuid.UUID{x, x}, ids, name)
	}

	// Upper case in the payload: the header gets the canonical form.
	msg := message.NewMessage(watermill.NewUUID(), payloadWithID(strings.ToUpper(x.String())))
	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, x, id)
	require.Equal(t, x.String(), msg.Metadata.Get(publisher.MetadataEventID))

	// An empty msg.UUID becomes the event id, as before.
	msg = message.NewMessage("", payloadWithID(x.String()))
	_, err = publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, x.String(), msg.UUID)
}

// A header and a payload id that agree are fine (stamping a stamped message
// changes nothing); ids that differ are refused, never resolved.
func TestStamp_HeaderAndPayloadEventIDMustAgree(t *testing.T) {
	t.Parallel()
	x, y := publisher.NewEventID(), publisher.NewEventID()

	msg := message.NewMessage(watermill.NewUUID(), payloadWithID(x.String()))
	msg.Metadata.Set(publisher.MetadataEventID, strings.ToUpper(x.String()))
	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, x, id)

	msg = message.NewMessage(watermill.NewUUID(), payloadWithID(y.String()))
	msg.Metadata.Set(publisher.MetadataEventID, x.String())
	_, err = publisher.Stamp(context.Background(), msg)
	require.ErrorIs(t, err, publisher.ErrEventIDMismatch)
	var se *publisher.EventIDError
	require.ErrorAs(t, err, &se)
	require.Equal(t, "payload", se.Source)
	require.True(t, idem.IsPermanent(err))
	require.Contains(t, err.Error(), x.String())
	require.Contains(t, err.Error(), y.String())
	require.Equal(t, x.String(), msg.Metadata.Get(publisher.MetadataEventID), "the header is left as it was")
	require.Empty(t, msg.Metadata.Get(publisher.MetadataOccurredAt), "nothing stamped on a refused message")
}

// A payload eventId that is present but not a UUIDv7 is refused; the
// message is left unstamped.
func TestStamp_InvalidPayloadEventIDIsAnError(t *testing.T) {
	t.Parallel()
	v7 := publisher.NewEventID().String()
	cases := []struct {
		name    string
		payload string
		want    error
	}{
		{"not a UUID", `{"eventId":"order-42"}`, publisher.ErrInvalidEventID},
		{"braces", `{"eventId":"{` + v7 + `}"}`, publisher.ErrInvalidEventID},
		{"a number", `{"eventId":42}`, publisher.ErrInvalidEventID},
		{"twice", `{"eventId":"` + v7 + `","eventId":"` + publisher.NewEventID().String() + `"}`, publisher.ErrInvalidEventID},
		{"nil UUID", `{"eventId":"` + uuid.Nil.String() + `"}`, publisher.ErrNilEventID},
		{"UUIDv4", `{"eventId":"` + uuid.NewString() + `"}`, publisher.ErrNotUUIDv7},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			msg := message.NewMessage(publisher.NewEventID().String(), []byte(c.payload))
			_, err := publisher.Stamp(context.Background(), msg)
			require.ErrorIs(t, err, c.want)
			var se *publisher.EventIDError
			require.True(t, errors.As(err, &se))
			require.Equal(t, "payload", se.Source)
			require.True(t, idem.IsPermanent(err))
			require.Empty(t, msg.Metadata.Get(publisher.MetadataEventID), "no event_id invented next to a bad payload id")
		})
	}
}

// Payloads without a top-level eventId are not an error: the usual rule
// applies (msg.UUID if v7, else a new id).
func TestStamp_NoPayloadEventID(t *testing.T) {
	t.Parallel()
	other := publisher.NewEventID().String()
	for name, payload := range map[string]string{
		"not JSON":               "amount=1 eventId=" + other,
		"JSON array":             `[{"eventId":"` + other + `"}]`,
		"nested deeper":          `{"order":{"eventId":"` + other + `"}}`,
		"other case":             `{"EventId":"` + other + `"}`,
		"null":                   `{"eventId":null}`,
		"empty":                  `{"eventId":""}`,
		"truncated JSON":         `{"eventId":"` + other + `"`,
		"no eventId at all":      `{"orderId":"order-42"}`,
		"empty payload":          ``,
		"eventId inside a value": `{"note":"eventId ` + other + `"}`,
	} {
		v7 := publisher.NewEventID()
		msg := message.NewMessage(v7.String(), []byte(payload))
		id, err := publisher.Stamp(context.Background(), msg)
		require.NoError(t, err, name)
		require.Equal(t, v7, id, "%s: msg.UUID is the event id", name)

		msg = message.NewMessage(watermill.NewUUID(), []byte(payload))
		id, err = publisher.Stamp(context.Background(), msg)
		require.NoError(t, err, name)
		require.NotEqual(t, other, id.String(), name)
		require.EqualValues(t, 7, id.Version(), name)
	}
}

func TestStampingPublisher_PayloadEventID(t *testing.T) {
	t.Parallel()
	next := &recordingPublisher{}
	p := publisher.NewStampingPublisher(next)
	x := publisher.NewEventID()

	require.NoError(t, p.Publish("topic",
		message.NewMessage(watermill.NewUUID(), payloadWithID(x.String())),
		message.NewMessage(watermill.NewUUID(), payloadWithID(x.String()))))
	require.Len(t, next.got, 2)
	for _, m := range next.got {
		require.Equal(t, x.String(), m.Metadata.Get(publisher.MetadataEventID))
	}

	good := message.NewMessage(watermill.NewUUID(), payloadWithID(publisher.NewEventID().String()))
	bad := message.NewMessage(watermill.NewUUID(), payloadWithID(publisher.NewEventID().String()))
	bad.Metadata.Set(publisher.MetadataEventID, x.String())
	err := p.Publish("topic", good, bad)
	require.ErrorIs(t, err, publisher.ErrEventIDMismatch)
	require.Equal(t, 1, strings.Count(err.Error(), publisher.ErrEventIDMismatch.Error()), "the reason is stated once: %s", err)
	require.Len(t, next.got, 2, "nothing of a batch with a bad message is published")
}
