package middleware_test

// Messages without a usable event id are refused with a typed, permanent
// error before any transaction is opened; the handler never runs.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestRefusedEventIDs(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	v4 := uuid.New()

	cases := []struct {
		name     string
		metadata map[string]string
		payload  string
		reason   error
		source   string
	}{
		{"no metadata, empty payload", nil, "", publisher.ErrMissingEventID, "payload"},
		{"no metadata, payload not JSON", nil, "amount=1", publisher.ErrMissingEventID, "payload"},
		{"no metadata, JSON without eventId", nil, `{"amount":1}`, publisher.ErrMissingEventID, "payload"},
		{"empty metadata", map[string]string{"event_id": ""}, `{"amount":1}`, publisher.ErrMissingEventID, "metadata"},
		{"malformed metadata", map[string]string{"event_id": "not-a-uuid"}, "", publisher.ErrInvalidEventID, "metadata"},
		{"braces", map[string]string{"event_id": "{" + publisher.NewEventID().String() + "}"}, "", publisher.ErrInvalidEventID, "metadata"},
		{"urn prefix", map[string]string{"event_id": "urn:uuid:" + publisher.NewEventID().String()}, "", publisher.ErrInvalidEventID, "metadata"},
		{"no hyphens", map[string]string{"event_id": fmt.Sprintf("%x", publisher.NewEventID())}, "", publisher.ErrInvalidEventID, "metadata"},
		{"surrounding space", map[string]string{"event_id": " " + publisher.NewEventID().String()[1:]}, "", publisher.ErrInvalidEventID, "metadata"},
		{"nil UUID", map[string]string{"event_id": uuid.Nil.String()}, "", publisher.ErrNilEventID, ""},
		{"UUIDv4", map[string]string{"event_id": v4.String()}, "", publisher.ErrNotUUIDv7, ""},
		{"payload eventId not a string", nil, `{"eventId":42}`, publisher.ErrInvalidEventID, "payload"},
		{"payload eventId empty", nil, `{"eventId":""}`, publisher.ErrMissingEventID, "payload"},
		{"payload eventId malformed", nil, `{"eventId":"nope"}`, publisher.ErrInvalidEventID, "payload"},
		{"payload eventId nil UUID", nil, `{"eventId":"` + uuid.Nil.String() + `"}`, publisher.ErrNilEventID, ""},
		{"payload eventId v4", nil, `{"eventId":"` + v4.String() + `"}`, publisher.ErrNotUUIDv7, ""},
	}
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(1, &calls))
	for _, tc := range cases {
		m := message.NewMessage(uuid.NewString(), []byte(tc.payload))
		for k, v := range tc.metadata {
			m.Metadata.Set(k, v)
		}
		f.sql.reset()
		_, err := h(m)
		require.ErrorIs(t, err, tc.reason, tc.name)
		require.True(t, idem.IsPermanent(err), "%s: refusals go to the poison queue", tc.name)
		var ee *publisher.EventIDError
		require.ErrorAs(t, err, &ee, tc.name)
		require.Equal(t, tc.reason, ee.Reason, tc.name)
		if tc.source != "" {
			require.Equal(t, tc.source, ee.Source, tc.name)
		}
		require.NotEmpty(t, err.Error())
		require.Zero(t, f.sql.total(), "%s: no statement sent, no transaction opened", tc.name)
	}
	require.Zero(t, calls.Load(), "the handler never ran")
	require.Zero(t, f.claims(t))
	require.Zero(t, f.ledgerRows(t))
}

func TestAllowNonV7AcceptsOtherVersions(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", func(c *idem.Config) { c.AllowNonV7 = true }).Middleware(f.insertHandler(1, &calls))

	v4 := uuid.New()
	for range 2 {
		_, err := h(f.msg(v4))
		require.NoError(t, err)
	}
	_, err := h(f.msg(uuid.Nil))
	require.ErrorIs(t, err, publisher.ErrNilEventID, "the nil UUID stays refused")

	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", v4))
}

func TestEventIDFromJSONPayloadWhenNoMetadata(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", nil).Middleware(f.insertHandler(1, &calls))

	id := publisher.NewEventID()
	payload := []byte(`{"amount":5,"eventId":"` + id.String() + `"}`)
	for range 2 {
		_, err := h(message.NewMessage(uuid.NewString(), payload))
		require.NoError(t, err)
	}
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id))
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", id))
}

func TestEventIDFromMetadataIgnoresPayload(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", func(c *idem.Config) { c.EventIDFunc = publisher.EventIDFromMetadata(false) }).Middleware(f.insertHandler(1, &calls))

	_, err := h(message.NewMessage(uuid.NewString(), []byte(`{"eventId":"`+publisher.NewEventID().String()+`"}`)))
	require.ErrorIs(t, err, publisher.ErrMissingEventID)
	require.True(t, idem.IsPermanent(err))
	require.Zero(t, calls.Load())
}

// A custom EventIDFunc's plain error is made routable: it becomes a
// *publisher.EventIDError (ErrInvalidEventID, source "func") that keeps the message.
func TestCustomEventIDFuncErrorIsPermanent(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", func(c *idem.Config) {
		c.EventIDFunc = func(*message.Message) (uuid.UUID, error) { return uuid.Nil, errors.New("no order number") }
	}).Middleware(f.insertHandler(1, &calls))

	_, err := h(f.msg(publisher.NewEventID()))
	require.ErrorIs(t, err, publisher.ErrInvalidEventID)
	require.True(t, idem.IsPermanent(err))
	var ee *publisher.EventIDError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "func", ee.Source)
	require.Contains(t, err.Error(), "no order number")
	require.Zero(t, calls.Load())
}

func TestIsPermanent(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		publisher.ErrMissingEventID, publisher.ErrInvalidEventID, publisher.ErrNilEventID, publisher.ErrNotUUIDv7,
		publisher.ErrEventIDMismatch, deduplicator.ErrStaleEvent, idem.ErrMalformedPayload,
		fmt.Errorf("decode order: %w", idem.ErrMalformedPayload),
		idem.Permanent(errors.New("amount must be positive")),
		fmt.Errorf("wrapped twice: %w", idem.Permanent(errors.New("x"))),
		&publisher.EventIDError{Reason: publisher.ErrNotUUIDv7},
	} {
		require.True(t, idem.IsPermanent(err), "%v", err)
	}
	for _, err := range []error{
		nil,
		errors.New("connection refused"),
		context.DeadlineExceeded,
		context.Canceled,
		&pgconn.PgError{Code: pgerrcode.SerializationFailure},
		&pgconn.PgError{Code: pgerrcode.DeadlockDetected},
	} {
		require.False(t, idem.IsPermanent(err), "%v", err)
	}
	require.NoError(t, idem.Permanent(nil))
	inner := errors.New("inner")
	require.ErrorIs(t, idem.Permanent(inner), inner)
}

// A handler that wraps a decoding failure with ErrMalformedPayload rolls back
// like any error, and the error stays routable to the poison queue.
func TestHandlerMalformedPayloadIsPermanentAndRolledBack(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	var calls atomic.Int32
	h := f.dedup(t, "billing", nil).Middleware(f.failingHandler(1, &calls, fmt.Errorf("decode order: %w", idem.ErrMalformedPayload)))
	_, err := h(f.msg(publisher.NewEventID()))
	require.ErrorIs(t, err, idem.ErrMalformedPayload)
	require.True(t, idem.IsPermanent(err))
	require.EqualValues(t, 1, calls.Load())
	require.Zero(t, f.claims(t))
	require.Zero(t, f.ledgerRows(t))
}
