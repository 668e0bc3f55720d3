package middleware_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// badInputPoison records what PoisonQueueWithFilter publishes.
type badInputPoison struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *badInputPoison) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *badInputPoison) Close() error { return nil }

// byUUID returns the poisoned copies of the message with this UUID.
func (p *badInputPoison) byUUID(id string) []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*message.Message
	for _, m := range p.msgs {
		if m.UUID == id {
			out = append(out, m)
		}
	}
	return out
}

func badInputV7At(t time.Time) uuid.UUID {
	id := publisher.NewEventID()
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()))
	copy(id[0:6], ms[2:8])
	return id
}

// TestBadInput delivers each kind of bad (and borderline) input twice
// through the documented chain, PoisonQueueWithFilter(IsPermanent) → dedup
// middleware → handler, and checks the documented outcome: processed exactly
// once (second delivery a duplicate), or sent to the poison topic with the
// reason on each delivery, the handler never run and nothing written. No
// delivery ends without one of these outcomes (nothing silently dropped).
func TestBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, `CREATE TABLE bad_input_ledger (event_id uuid NOT NULL, consumer_group text NOT NULL, payload_len int NOT NULL)`)

	v7 := func() string { return publisher.NewEventID().String() }
	big := func(b byte) []byte { return bytes.Repeat([]byte{b}, 10<<20) }
	bigJSON := append(append([]byte(`{"blob":"`), big('x')...), []byte(`"}`)...)
	upper := strings.ToUpper(v7())

	type outcome struct {
		processed bool
		reason    error // poisoned with this sentinel
	}
	processed := outcome{processed: true}
	poison := func(err error) outcome { return outcome{reason: err} }

	cases := []struct {
		name    string
		header  *string // nil: no event_id metadata
		payload []byte
		cfg     func(*idem.Config)
		want    outcome
		sameAs  string // processed: the canonical id expected in processed_event
	}{
		{name: "no header and no JSON field", payload: []byte(`{"amount":1}`), want: poison(publisher.ErrMissingEventID)},
		{name: "no header and empty payload", payload: nil, want: poison(publisher.ErrMissingEventID)},
		{name: "empty header value", header: badInputPtr(""), payload: []byte(`{}`), want: poison(publisher.ErrMissingEventID)},
		{name: "empty JSON field", payload: []byte(`{"eventId":""}`), want: poison(publisher.ErrMissingEventID)},
		{name: "not a UUID", header: badInputPtr("order-42"), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "UUID in braces", header: badInputPtr("{" + v7() + "}"), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "urn:uuid prefix", header: badInputPtr("urn:uuid:" + v7()), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "no hyphens", header: badInputPtr(strings.ReplaceAll(v7(), "-", "")), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "header with spaces", header: badInputPtr(" " + v7() + " "), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "header with a trailing newline", header: badInputPtr(v7() + "\n"), payload: []byte(`{}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "upper case UUIDv7 (same UUID)", header: badInputPtr(upper), payload: []byte(`{}`), want: processed, sameAs: strings.ToLower(upper)},
		{name: "UUIDv4", header: badInputPtr(uuid.NewString()), payload: []byte(`{}`), want: poison(publisher.ErrNotUUIDv7)},
		{name: "UUIDv4 with AllowNonV7", header: badInputPtr(uuid.NewString()), payload: []byte(`{}`), cfg: func(c *idem.Config) { c.AllowNonV7 = true }, want: processed},
		{name: "nil UUID", header: badInputPtr(uuid.Nil.String()), payload: []byte(`{}`), want: poison(publisher.ErrNilEventID)},
		{name: "nil UUID with AllowNonV7", header: badInputPtr(uuid.Nil.String()), payload: []byte(`{}`), cfg: func(c *idem.Config) { c.AllowNonV7 = true }, want: poison(publisher.ErrNilEventID)},
		{name: "max UUID (non-RFC variant)", header: badInputPtr("ffffffff-ffff-ffff-ffff-ffffffffffff"), payload: []byte(`{}`), cfg: func(c *idem.Config) { c.AllowNonV7 = true }, want: poison(publisher.ErrInvalidEventID)},
		{name: "UUIDv7 from the far future", header: badInputPtr(badInputV7At(time.Now().AddDate(30, 0, 0)).String()), payload: []byte(`{}`), want: processed},
		{name: "UUIDv7 older than the retention", header: badInputPtr(badInputV7At(time.Now().Add(-deduplicator.DefaultRetention - time.Minute)).String()), payload: []byte(`{}`), want: poison(deduplicator.ErrStaleEvent)},
		{name: "UUIDv7 older than the retention, ProcessStaleEvents", header: badInputPtr(badInputV7At(time.Now().Add(-deduplicator.DefaultRetention - time.Minute)).String()), payload: []byte(`{}`), cfg: func(c *idem.Config) { c.ProcessStaleEvents = true }, want: processed},
		{name: "non-JSON payload, no header (JSON fallback on)", payload: []byte("amount=1\x00\xff"), want: poison(publisher.ErrMissingEventID)},
		{name: "non-JSON payload with a valid header", header: badInputPtr(v7()), payload: []byte("amount=1\x00\xff"), want: processed},
		{name: "JSON eventId only (fallback)", payload: []byte(`{"eventId":"` + v7() + `","amount":1}`), want: processed},
		{name: "JSON eventId only, fallback off", payload: []byte(`{"eventId":"` + v7() + `"}`), cfg: func(c *idem.Config) { c.EventIDFunc = publisher.EventIDFromMetadata(false) }, want: poison(publisher.ErrMissingEventID)},
		{name: "JSON eventId not a string", payload: []byte(`{"eventId":12345}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "JSON array payload", payload: []byte(`[{"eventId":"` + v7() + `"}]`), want: poison(publisher.ErrMissingEventID)},
		{name: "invalid header wins over a valid JSON field", header: badInputPtr("nope"), payload: []byte(`{"eventId":"` + v7() + `"}`), want: poison(publisher.ErrInvalidEventID)},
		{name: "10 MB payload with a valid header", header: badInputPtr(v7()), payload: big('x'), want: processed},
		{name: "10 MB non-JSON payload, no header", payload: big('x'), want: poison(publisher.ErrMissingEventID)},
		{name: "10 MB JSON payload without eventId, no header", payload: bigJSON, want: poison(publisher.ErrMissingEventID)},
	}

	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			group := "bad-input-" + strings.NewReplacer(" ", "-").Replace(tc.name)
			cfg := idem.Config{DB: db.Pool, ConsumerGroup: group, Table: table}
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			ageGroup(t, db, group) // a group that may have lost claims: its stale guard is on
			dedup, err := idem.NewDedup(cfg, nil)
			require.NoError(t, err)
			poisonPub := &badInputPoison{}
			poisonMW, err := wmiddleware.PoisonQueueWithFilter(poisonPub, "events-poison", idem.IsPermanent)
			require.NoError(t, err)

			var runs atomic.Int32
			handler := poisonMW(dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				id, _ := idem.EventIDFromContext(msg.Context())
				_, err := idem.MustTxFromContext(msg.Context()).Exec(msg.Context(),
					`INSERT INTO bad_input_ledger VALUES ($1, $2, $3)`, id, group, len(msg.Payload))
				return nil, err
			}))

			msg := message.NewMessage(uuid.NewString(), tc.payload)
			if tc.header != nil {
				msg.Metadata.Set(publisher.MetadataEventID, *tc.header)
			}
			for delivery := range 2 {
				m := msg.Copy()
				m.SetContext(ctx)
				out, err := handler(m)
				require.NoError(t, err, "delivery %d: the chain must end in processed, duplicate or poison, never an error", delivery)
				require.Empty(t, out)
			}

			rows := db.Count(t, `SELECT 1 FROM bad_input_ledger WHERE consumer_group = $1`, group)
			claims := db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = $1`, group)
			poisoned := poisonPub.byUUID(msg.UUID)
			if tc.want.processed {
				require.EqualValues(t, 1, runs.Load(), "handler runs")
				require.Equal(t, 1, rows, "business rows")
				require.Equal(t, 1, claims, "claims")
				require.Empty(t, poisoned, "a processed message must not also be poisoned")
				var seen int
				require.NoError(t, db.Pool.QueryRow(ctx, `SELECT payload_len FROM bad_input_ledger WHERE consumer_group = $1`, group).Scan(&seen))
				require.Equal(t, len(tc.payload), seen, "the handler saw the whole payload")
				if tc.sameAs != "" {
					require.Equal(t, 1, db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = $1 AND event_id::text = $2`, group, tc.sameAs))
					// The lower-case spelling is the same event: a duplicate.
					m := msg.Copy()
					m.Metadata.Set(publisher.MetadataEventID, tc.sameAs)
					m.SetContext(ctx)
					_, err := handler(m)
					require.NoError(t, err)
					require.EqualValues(t, 1, runs.Load(), "the lower-case spelling must be deduplicated")
				}
				return
			}
			require.Zero(t, runs.Load(), "the handler must not run on refused input")
			require.Zero(t, rows, "nothing written")
			require.Zero(t, claims, "no claim for refused input")
			require.Len(t, poisoned, 2, "each delivery goes to the poison topic")
			for _, p := range poisoned {
				reason := p.Metadata.Get(wmiddleware.ReasonForPoisonedKey)
				require.Contains(t, reason, tc.want.reason.Error(), "poison reason")
				require.Equal(t, tc.payload, []byte(p.Payload), "the poisoned message keeps its payload for inspection")
				require.LessOrEqual(t, len(reason), 1024, "the reason must not embed the payload")
			}
			// The same error, checked directly: typed and permanent.
			_, err = dedup.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg.Copy())
			require.True(t, errors.Is(err, tc.want.reason), "errors.Is(%v, %v)", err, tc.want.reason)
			require.True(t, idem.IsPermanent(err))
			if !errors.Is(tc.want.reason, deduplicator.ErrStaleEvent) {
				var ee *publisher.EventIDError
				require.ErrorAs(t, err, &ee)
			}
		})
	}
}

func badInputPtr[T any](v T) *T { return &v }

// all returns every poisoned message.
func (p *badInputPoison) all() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.msgs...)
}
