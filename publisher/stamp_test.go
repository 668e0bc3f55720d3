package publisher_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestStamp_NewIDKeepsCallerUUID(t *testing.T) {
	t.Parallel()
	v4 := watermill.NewUUID() // a UUIDv4
	msg := message.NewMessage(v4, []byte(`{}`))
	before := time.Now().UTC().Truncate(time.Second)

	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, v4, msg.UUID, "msg.UUID must never be overwritten")
	require.EqualValues(t, 7, id.Version())
	require.Equal(t, id.String(), msg.Metadata.Get(publisher.MetadataEventID))

	at, err := time.Parse(time.RFC3339, msg.Metadata.Get(publisher.MetadataOccurredAt))
	require.NoError(t, err)
	require.False(t, at.Before(before))
	require.Empty(t, msg.Metadata.Get(publisher.MetadataCausationID))
	require.Empty(t, msg.Metadata.Get(publisher.MetadataCorrelationID))
}

func TestStamp_ReusesUUIDv7MessageUUID(t *testing.T) {
	t.Parallel()
	v7 := publisher.NewEventID().String()
	msg := message.NewMessage(v7, nil)
	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, v7, id.String())
	require.Equal(t, v7, msg.Metadata.Get(publisher.MetadataEventID))
	require.Equal(t, v7, msg.UUID)
}

func TestStamp_KeepsValidEventIDAndIsIdempotent(t *testing.T) {
	t.Parallel()
	existing := publisher.NewEventID().String()
	msg := message.NewMessage(publisher.NewEventID().String(), nil)
	msg.Metadata.Set(publisher.MetadataEventID, existing)
	msg.Metadata.Set(publisher.MetadataOccurredAt, "2026-01-02T03:04:05Z")

	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, existing, id.String())
	require.Equal(t, "2026-01-02T03:04:05Z", msg.Metadata.Get(publisher.MetadataOccurredAt))

	before := msg.Metadata.Get(publisher.MetadataEventID)
	again, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, id, again)
	require.Equal(t, before, msg.Metadata.Get(publisher.MetadataEventID))
}

func TestStamp_EmptyUUIDGetsEventID(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("", nil)
	id, err := publisher.Stamp(context.Background(), msg)
	require.NoError(t, err)
	require.Equal(t, id.String(), msg.UUID)
}

func TestStamp_InvalidExistingEventIDIsAnError(t *testing.T) {
	t.Parallel()
	cases := []struct {
		value string
		want  error
	}{
		{"not-a-uuid", publisher.ErrInvalidEventID},
		{"{" + publisher.NewEventID().String() + "}", publisher.ErrInvalidEventID},
		{uuid.Nil.String(), publisher.ErrNilEventID},
		{uuid.NewString(), publisher.ErrNotUUIDv7}, // v4
	}
	for _, c := range cases {
		t.Run(c.value, func(t *testing.T) {
			t.Parallel()
			msg := message.NewMessage(publisher.NewEventID().String(), nil)
			msg.Metadata.Set(publisher.MetadataEventID, c.value)
			_, err := publisher.Stamp(context.Background(), msg)
			require.ErrorIs(t, err, c.want)
			var se *publisher.EventIDError
			require.True(t, errors.As(err, &se))
			require.Equal(t, "metadata", se.Source)
			require.True(t, idem.IsPermanent(err), "the middleware recognises publisher's sentinels")
			require.Equal(t, c.value, msg.Metadata.Get(publisher.MetadataEventID), "never silently replaced")
		})
	}
}

func TestStamp_CausationAndCorrelationFromHandlerContext(t *testing.T) {
	t.Parallel()
	incoming := publisher.NewEventID()

	t.Run("correlation carried through", func(t *testing.T) {
		ctx := idemctx.With(context.Background(), &idemctx.Value{EventID: incoming, CorrelationID: "order-42"})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		_, err := publisher.Stamp(ctx, msg)
		require.NoError(t, err)
		require.Equal(t, incoming.String(), msg.Metadata.Get(publisher.MetadataCausationID))
		require.Equal(t, "order-42", msg.Metadata.Get(publisher.MetadataCorrelationID))
	})
	t.Run("chain starts at the incoming event", func(t *testing.T) {
		ctx := idemctx.With(context.Background(), &idemctx.Value{EventID: incoming})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		_, err := publisher.Stamp(ctx, msg)
		require.NoError(t, err)
		require.Equal(t, incoming.String(), msg.Metadata.Get(publisher.MetadataCorrelationID))
	})
	t.Run("caller values win", func(t *testing.T) {
		ctx := idemctx.With(context.Background(), &idemctx.Value{EventID: incoming, CorrelationID: "order-42"})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata.Set(publisher.MetadataCausationID, "mine")
		msg.Metadata.Set(publisher.MetadataCorrelationID, "also-mine")
		_, err := publisher.Stamp(ctx, msg)
		require.NoError(t, err)
		require.Equal(t, "mine", msg.Metadata.Get(publisher.MetadataCausationID))
		require.Equal(t, "also-mine", msg.Metadata.Get(publisher.MetadataCorrelationID))
	})
}

func TestStamp_IDsIncrease(t *testing.T) {
	t.Parallel()
	var prev string
	for i := 0; i < 1000; i++ {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		id, err := publisher.Stamp(context.Background(), msg)
		require.NoError(t, err)
		require.Greater(t, id.String(), prev)
		prev = id.String()
	}
}

func TestWithPartitionKey(t *testing.T) {
	t.Parallel()
	msg := publisher.WithPartitionKey(&message.Message{}, "order-7")
	require.Equal(t, "order-7", msg.Metadata.Get(publisher.MetadataPartitionKey))
	pm, err := idemkafka.Marshaler{}.Marshal("t", msg)
	require.NoError(t, err)
	key, err := pm.Key.Encode()
	require.NoError(t, err)
	require.Equal(t, "order-7", string(key))
}

type recordingPublisher struct {
	got    []*message.Message
	closed bool
}

func (r *recordingPublisher) Publish(_ string, msgs ...*message.Message) error {
	r.got = append(r.got, msgs...)
	return nil
}
func (r *recordingPublisher) Close() error { r.closed = true; return nil }

func TestStampingPublisher(t *testing.T) {
	t.Parallel()
	next := &recordingPublisher{}
	p := publisher.NewStampingPublisher(next)

	incoming := publisher.NewEventID()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.SetContext(idemctx.With(context.Background(), &idemctx.Value{EventID: incoming}))
	require.NoError(t, p.Publish("topic", msg))
	require.Len(t, next.got, 1)
	_, err := publisher.ParseEventID(next.got[0].Metadata.Get(publisher.MetadataEventID))
	require.NoError(t, err)
	require.Equal(t, incoming.String(), next.got[0].Metadata.Get(publisher.MetadataCausationID))

	good := message.NewMessage(watermill.NewUUID(), nil)
	bad := message.NewMessage(watermill.NewUUID(), nil)
	bad.Metadata.Set(publisher.MetadataEventID, "nope")
	err = p.Publish("topic", good, bad)
	require.ErrorIs(t, err, publisher.ErrInvalidEventID)
	require.Len(t, next.got, 1, "nothing of a batch with a bad message is published")

	require.NoError(t, p.Close())
	require.True(t, next.closed)
}

// Stamp a message before publishing it: a UUIDv7 msg.UUID becomes the event
// id; other metadata is added next to it.
func ExampleStamp() {
	id := publisher.NewEventID()
	msg := message.NewMessage(id.String(), []byte(`{"orderId":"order-42","total":1200}`))
	publisher.WithPartitionKey(msg, "order-42")

	eventID, err := publisher.Stamp(context.Background(), msg)
	if err != nil {
		panic(err)
	}
	_, err = time.Parse(time.RFC3339, msg.Metadata.Get(publisher.MetadataOccurredAt))
	fmt.Println("event id reused from msg.UUID:", eventID == id)
	fmt.Println("version:", eventID.Version())
	fmt.Println("partition key:", msg.Metadata.Get(publisher.MetadataPartitionKey))
	fmt.Println("occurred_at is RFC 3339:", err == nil)

	bad := message.NewMessage(watermill.NewUUID(), nil)
	bad.Metadata.Set(publisher.MetadataEventID, "12345")
	_, err = publisher.Stamp(context.Background(), bad)
	fmt.Println("invalid event_id refused:", errors.Is(err, publisher.ErrInvalidEventID))
	// Output:
	// event id reused from msg.UUID: true
	// version: VERSION_7
	// partition key: order-42
	// occurred_at is RFC 3339: true
	// invalid event_id refused: true
}

// Stamp carries the trace of ctx in the W3C headers, keeps a traceparent
// the message already has, and adds none without a span.
func TestStamp_TraceContext(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, span := tp.Tracer("test").Start(context.Background(), "order tx")
	defer span.End()

	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	_, err := publisher.Stamp(ctx, m)
	require.NoError(t, err)
	require.Contains(t, m.Metadata.Get("traceparent"), span.SpanContext().TraceID().String())

	kept := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	kept.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	_, err = publisher.Stamp(ctx, kept)
	require.NoError(t, err)
	require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", kept.Metadata.Get("traceparent"))

	none := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	_, err = publisher.Stamp(context.Background(), none)
	require.NoError(t, err)
	require.Empty(t, none.Metadata.Get("traceparent"))
}
