package poison

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestFilterMatch(t *testing.T) {
	t.Parallel()
	id := publisher.NewEventID()
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	m := Message{Reason: "permanent: unknown product P-7", OriginalTopic: "orders", EventID: id.String(),
		PoisonedAt: at, OccurredAt: at.Add(-time.Hour), Handler: "ledger"}
	for name, tc := range map[string]struct {
		f    Filter
		want bool
	}{
		"zero":                   {Filter{}, true},
		"reason substring":       {Filter{Reason: "unknown product"}, true},
		"reason other":           {Filter{Reason: "timeout"}, false},
		"reason exact":           {Filter{Reason: "permanent: unknown product P-7", ReasonExact: true}, true},
		"reason exact partial":   {Filter{Reason: "unknown product", ReasonExact: true}, false},
		"topic":                  {Filter{OriginalTopic: "orders"}, true},
		"other topic":            {Filter{OriginalTopic: "payments"}, false},
		"handler":                {Filter{Handler: "ledger"}, true},
		"other handler":          {Filter{Handler: "shipping"}, false},
		"event id":               {Filter{EventIDs: []uuid.UUID{publisher.NewEventID(), id}}, true},
		"other event id":         {Filter{EventIDs: []uuid.UUID{publisher.NewEventID()}}, false},
		"poisoned from (incl.)":  {Filter{PoisonedFrom: at}, true},
		"poisoned to (excl.)":    {Filter{PoisonedTo: at}, false},
		"poisoned in range":      {Filter{PoisonedFrom: at.Add(-time.Minute), PoisonedTo: at.Add(time.Minute)}, true},
		"occurred before":        {Filter{OccurredTo: at.Add(-30 * time.Minute)}, true},
		"occurred after":         {Filter{OccurredFrom: at}, false},
		"all set, all matching":  {Filter{Reason: "P-7", OriginalTopic: "orders", EventIDs: []uuid.UUID{id}, PoisonedFrom: at}, true},
		"all set, one different": {Filter{Reason: "P-7", OriginalTopic: "orders", EventIDs: []uuid.UUID{id}, PoisonedFrom: at.Add(time.Second)}, false},
	} {
		require.Equal(t, tc.want, tc.f.match(m), name)
	}
	require.False(t, Filter{OccurredFrom: at.Add(-48 * time.Hour)}.match(Message{}), "no occurrence time: no match when a bound is set")
	require.False(t, Filter{EventIDs: []uuid.UUID{id}}.match(Message{EventID: "garbage"}))
}

func TestFilterValidate(t *testing.T) {
	t.Parallel()
	at := time.Now()
	require.ErrorContains(t, Filter{PoisonedFrom: at, PoisonedTo: at}.validate(), "Filter.PoisonedFrom")
	require.ErrorContains(t, Filter{OccurredFrom: at, OccurredTo: at.Add(-1)}.validate(), "Filter.OccurredFrom")
	require.ErrorContains(t, Filter{ReasonExact: true}.validate(), "Filter.ReasonExact")
	require.NoError(t, Filter{PoisonedFrom: at, PoisonedTo: at.Add(1)}.validate())
}

// A message poisoned on a retry topic goes back with its original
// headers: the poison keys and the retry headers removed, the poisoning
// appended to the history, the record key kept as partition_key.
func TestRestore(t *testing.T) {
	t.Parallel()
	id := publisher.NewEventID()
	msg := message.NewMessage("uuid-1", []byte(`{"n":1}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	msg.Metadata.Set("traceparent", "00-abc-def-01")
	msg.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "retry attempts exhausted after 3 retry-topic attempts: timeout")
	msg.Metadata.Set(wmiddleware.PoisonedTopicKey, "orders")
	msg.Metadata.Set(wmiddleware.PoisonedHandlerKey, "charge-retry")
	msg.Metadata.Set(wmiddleware.PoisonedSubscriberKey, "sub")
	msg.Metadata.Set(retrytopic.MetadataAttempt, "3")
	msg.Metadata.Set(retrytopic.MetadataNotBefore, "2026-01-01T00:00:00Z")
	msg.Metadata.Set(retrytopic.MetadataOriginalTopic, "orders")
	msg.Metadata.Set(retrytopic.MetadataOriginalPartition, "2")
	msg.Metadata.Set(retrytopic.MetadataOriginalOffset, "41")
	msg.Metadata.Set(retrytopic.MetadataError, "timeout")
	earlier := []HistoryEntry{{Reason: "first time", Topic: "orders", PoisonedAt: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}}
	b, _ := json.Marshal(earlier)
	msg.Metadata.Set(MetadataReasonHistory, string(b))

	poisonedAt := time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC)
	m := describe(msg, 0, 7, poisonedAt)
	require.Equal(t, "orders", m.OriginalTopic)
	require.Equal(t, id.String(), m.EventID)
	require.Len(t, m.History, 1)
	sec, nsec := id.Time().UnixTime()
	require.Equal(t, time.Unix(sec, nsec).UTC(), m.OccurredAt, "no occurred_at: the UUIDv7 time")

	now := time.Date(2026, 2, 2, 0, 0, 0, 0, time.UTC)
	out, err := restore(msg, m, []byte("acct-9"), now)
	require.NoError(t, err)
	require.Equal(t, "uuid-1", out.UUID)
	require.Equal(t, msg.Payload, out.Payload)
	require.Equal(t, message.Metadata{
		publisher.MetadataEventID:      id.String(),
		"traceparent":                  "00-abc-def-01",
		publisher.MetadataPartitionKey: "acct-9",
		MetadataReasonHistory:          out.Metadata.Get(MetadataReasonHistory),
	}, out.Metadata)
	require.Equal(t, []HistoryEntry{earlier[0], {
		Reason: "retry attempts exhausted after 3 retry-topic attempts: timeout", Topic: "orders",
		Handler: "charge-retry", Subscriber: "sub", Attempt: "3", PoisonedAt: poisonedAt, ReplayedAt: now,
	}}, history(out.Metadata.Get(MetadataReasonHistory)))
	require.Len(t, history(msg.Metadata.Get(MetadataReasonHistory)), 1, "the poison message itself is unchanged")

	require.Equal(t, []HistoryEntry{{Reason: "unparsable reason_poisoned_history: {"}}, history("{"))
	noTopic := describe(message.NewMessage("u", nil), 0, 0, now)
	require.NotEmpty(t, noTopic.Skipped)
}

func TestInterval(t *testing.T) {
	t.Parallel()
	require.Equal(t, 20*time.Millisecond, interval(50))
	require.Zero(t, interval(-1))
}
