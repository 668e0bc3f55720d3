package poison

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/retryheaders"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// MetadataReasonHistory is the metadata key (Kafka header) where a replayed
// message keeps its earlier poisonings: a JSON array of [HistoryEntry],
// oldest first. [Replay] appends the current one before it removes
// reason_poisoned and the other poison keys.
const MetadataReasonHistory = "reason_poisoned_history"

// Defaults.
const (
	// defaultRate is how many messages per second [Replay] publishes.
	defaultRate = 50.0
	// defaultIdleTimeout bounds the wait for the next record of a partition
	// that has not reached the end it had when the read started.
	defaultIdleTimeout = 30 * time.Second
)

var (
	// ErrIncompleteRead: a partition of the poison topic stopped delivering
	// before the end it had when the read started (a transactional producer's
	// trailing marker, or the broker went away) for longer than
	// Config.IdleTimeout. Nothing after that point was replayed.
	ErrIncompleteRead = errors.New("poison topic read stopped before its end")
	// ErrPublish wraps a failure to publish a replayed message; the
	// [Result] tells how far the replay got.
	ErrPublish = errors.New("publish replayed message")
)

// HistoryEntry is one earlier poisoning of a message, kept in
// [MetadataReasonHistory] when it is replayed.
type HistoryEntry struct {
	// Reason is the reason_poisoned text.
	Reason string `json:"reason"`
	// Topic, Handler and Subscriber are topic_poisoned, handler_poisoned and
	// subscriber_poisoned.
	Topic      string `json:"topic,omitempty"`
	Handler    string `json:"handler,omitempty"`
	Subscriber string `json:"subscriber,omitempty"`
	// Attempt is the retry-topic attempt it was poisoned at (retrytopic's
	// retry_attempt header), "" when it never reached a retry topic.
	Attempt string `json:"attempt,omitempty"`
	// PoisonedAt is the poison record's Kafka timestamp.
	PoisonedAt time.Time `json:"poisoned_at"`
	// ReplayedAt is when it was replayed.
	ReplayedAt time.Time `json:"replayed_at"`
}

// Message is one record of the poison topic, as [List] and [Replay] report
// it (metadata only: the payload is never included). Its JSON form is what
// a command prints with --json.
type Message struct {
	// Partition and Offset locate the record in the poison topic.
	Partition int32 `json:"partition"`
	Offset    int64 `json:"offset"`
	// PoisonedAt is the record's Kafka timestamp: when it was poisoned.
	PoisonedAt time.Time `json:"poisoned_at"`
	// UUID is the watermill message UUID.
	UUID string `json:"uuid"`
	// EventID is the event id (event_id metadata, else the JSON payload's
	// eventId), as found: possibly invalid, which is why some messages are
	// poisoned. "" when absent.
	EventID string `json:"event_id"`
	// OccurredAt is the occurred_at metadata, else the time of a UUIDv7
	// event id; zero when neither is there.
	OccurredAt time.Time `json:"occurred_at"`
	// OriginalTopic, Reason, Handler and Subscriber are topic_poisoned,
	// reason_poisoned, handler_poisoned and subscriber_poisoned.
	OriginalTopic string `json:"original_topic"`
	Reason        string `json:"reason"`
	Handler       string `json:"handler"`
	Subscriber    string `json:"subscriber"`
	// History holds the earlier poisonings of a message replayed before.
	History []HistoryEntry `json:"history,omitempty"`
	// Replayed: published back to OriginalTopic (false in a dry run).
	Replayed bool `json:"replayed"`
	// Skipped tells why a matching message cannot be replayed ("" if it can).
	Skipped string `json:"skipped,omitempty"`
}

// Filter selects poison messages. The zero Filter matches every message; each
// field that is set narrows it.
type Filter struct {
	// Reason matches reason_poisoned: a case-sensitive substring, or the
	// whole text with ReasonExact.
	Reason      string
	ReasonExact bool
	// EventIDs keeps only these events.
	EventIDs []uuid.UUID
	// OriginalTopic keeps only messages poisoned from this topic
	// (topic_poisoned).
	OriginalTopic string
	// Handler keeps only messages poisoned by this handler
	// (handler_poisoned): one consumer's failures when several share the
	// poison topic.
	Handler string
	// PoisonedFrom and PoisonedTo bound [Message.PoisonedAt]: From
	// included, To excluded; a zero bound is open.
	PoisonedFrom, PoisonedTo time.Time
	// OccurredFrom and OccurredTo bound [Message.OccurredAt] the same way;
	// a message without an occurrence time does not match when either is
	// set.
	OccurredFrom, OccurredTo time.Time
}

func (f Filter) validate() error {
	if !f.PoisonedFrom.IsZero() && !f.PoisonedTo.IsZero() && !f.PoisonedFrom.Before(f.PoisonedTo) {
		return fmt.Errorf("Filter.PoisonedFrom: %s is not before PoisonedTo (%s)", f.PoisonedFrom, f.PoisonedTo)
	}
	if !f.OccurredFrom.IsZero() && !f.OccurredTo.IsZero() && !f.OccurredFrom.Before(f.OccurredTo) {
		return fmt.Errorf("Filter.OccurredFrom: %s is not before OccurredTo (%s)", f.OccurredFrom, f.OccurredTo)
	}
	if f.ReasonExact && f.Reason == "" {
		return errors.New("Filter.ReasonExact: needs a Reason")
	}
	return nil
}

// match reports whether m passes every field of f that is set.
func (f Filter) match(m Message) bool {
	if f.Reason != "" {
		if f.ReasonExact && m.Reason != f.Reason || !f.ReasonExact && !strings.Contains(m.Reason, f.Reason) {
			return false
		}
	}
	if f.OriginalTopic != "" && m.OriginalTopic != f.OriginalTopic || f.Handler != "" && m.Handler != f.Handler {
		return false
	}
	if len(f.EventIDs) > 0 {
		id, err := uuid.Parse(m.EventID)
		if err != nil || !slices.Contains(f.EventIDs, id) {
			return false
		}
	}
	if !inRange(m.PoisonedAt, f.PoisonedFrom, f.PoisonedTo) {
		return false
	}
	if (!f.OccurredFrom.IsZero() || !f.OccurredTo.IsZero()) && (m.OccurredAt.IsZero() || !inRange(m.OccurredAt, f.OccurredFrom, f.OccurredTo)) {
		return false
	}
	return true
}

func inRange(t, from, to time.Time) bool {
	return (from.IsZero() || !t.Before(from)) && (to.IsZero() || t.Before(to))
}

// describe returns what List and Replay report about msg.
func describe(msg *message.Message, partition int32, offset int64, ts time.Time) Message {
	md := msg.Metadata
	m := Message{
		Partition: partition, Offset: offset, PoisonedAt: ts, UUID: msg.UUID,
		OriginalTopic: md.Get(wmiddleware.PoisonedTopicKey),
		Reason:        md.Get(wmiddleware.ReasonForPoisonedKey),
		Handler:       md.Get(wmiddleware.PoisonedHandlerKey),
		Subscriber:    md.Get(wmiddleware.PoisonedSubscriberKey),
	}
	if id, err := publisher.EventIDFromMessage(msg); err == nil {
		m.EventID = id.String()
	} else {
		m.EventID = md.Get(publisher.MetadataEventID)
	}
	if t, err := time.Parse(time.RFC3339Nano, md.Get(publisher.MetadataOccurredAt)); err == nil {
		m.OccurredAt = t
	} else if id, err := uuid.Parse(m.EventID); err == nil && id.Version() == 7 {
		sec, nsec := id.Time().UnixTime()
		m.OccurredAt = time.Unix(sec, nsec).UTC()
	}
	m.History = history(md.Get(MetadataReasonHistory))
	if m.OriginalTopic == "" {
		m.Skipped = "no " + wmiddleware.PoisonedTopicKey + " metadata: the original topic is unknown"
	}
	return m
}

// history parses a MetadataReasonHistory value; an unparsable one is kept as
// one entry whose reason is the raw text.
func history(v string) []HistoryEntry {
	if v == "" {
		return nil
	}
	var h []HistoryEntry
	if err := json.Unmarshal([]byte(v), &h); err != nil {
		return []HistoryEntry{{Reason: "unparsable " + MetadataReasonHistory + ": " + v}}
	}
	return h
}

// restore returns the message to publish back: msg's UUID, payload and
// metadata without the poison keys and the retry-topic headers, with the
// current poisoning appended to MetadataReasonHistory. A record key without
// partition_key metadata becomes partition_key, so the event goes back to
// its key's partition.
func restore(msg *message.Message, m Message, recordKey []byte, now time.Time) (*message.Message, error) {
	out := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		out.Metadata.Set(k, v)
	}
	h := append(slices.Clone(m.History), HistoryEntry{
		Reason: m.Reason, Topic: m.OriginalTopic, Handler: m.Handler, Subscriber: m.Subscriber,
		Attempt:    msg.Metadata.Get(retrytopic.MetadataAttempt),
		PoisonedAt: m.PoisonedAt.UTC(), ReplayedAt: now.UTC(),
	})
	b, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	out.Metadata.Set(MetadataReasonHistory, string(b))
	for _, k := range []string{wmiddleware.ReasonForPoisonedKey, wmiddleware.PoisonedTopicKey,
		wmiddleware.PoisonedHandlerKey, wmiddleware.PoisonedSubscriberKey} {
		delete(out.Metadata, k)
	}
	for k := range out.Metadata {
		if retryheaders.Has(k) {
			delete(out.Metadata, k)
		}
	}
	if out.Metadata.Get(publisher.MetadataPartitionKey) == "" && len(recordKey) > 0 {
		out.Metadata.Set(publisher.MetadataPartitionKey, string(recordKey))
	}
	return out, nil
}

// interval is the pause between two publishes at rate messages per second.
func interval(rate float64) time.Duration {
	if rate <= 0 || math.IsInf(rate, 1) {
		return 0
	}
	return time.Duration(float64(time.Second) / rate)
}
