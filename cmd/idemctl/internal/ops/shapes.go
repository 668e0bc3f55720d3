package ops

import (
	"encoding/json"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Time is a time that marshals as RFC 3339 in UTC, and null when zero.
type Time time.Time

// MarshalJSON implements json.Marshaler.
func (t Time) MarshalJSON() ([]byte, error) {
	if time.Time(t).IsZero() {
		return []byte("null"), nil
	}
	return json.Marshal(time.Time(t).UTC().Format(time.RFC3339Nano))
}

// Group is a registered group in JSON output (groups list, and the
// console's overview and group page).
type Group struct {
	Group                string `json:"group"`
	FirstSeen            Time   `json:"first_seen"`
	IdempotencyNamespace string `json:"idempotency_namespace"`
	StartedAt            Time   `json:"started_at"`
	Young                bool   `json:"young"`
	Stale                bool   `json:"stale"`
}

// ToGroup is g's JSON shape at now under retention.
func ToGroup(g dedupsql.Group, now time.Time, retention time.Duration) Group {
	return Group{g.Name, Time(g.FirstSeen), g.IdempotencyNamespace, Time(g.StartedAt), g.Young(now, retention), GroupStale(g, now, retention)}
}

// GroupStale reports whether no consumer of the group has started for
// longer than the retention: a group that may be gone (forget it), or one
// whose consumers have run without a restart all that time.
func GroupStale(g dedupsql.Group, now time.Time, retention time.Duration) bool {
	return retention > 0 && !g.StartedAt.IsZero() && g.StartedAt.Before(now.Add(-retention))
}

// Parked is retry parked --json, and the console's parked keys.
type Parked struct {
	Groups []ParkedGroup `json:"groups"`
	Keys   []ParkedKey   `json:"keys"`
}

// ParkedKey is one parked key.
type ParkedKey struct {
	ConsumerGroup      string  `json:"consumer_group"`
	Key                string  `json:"key"`
	Events             int64   `json:"events"`
	Head               string  `json:"head"`
	HeadTopic          string  `json:"head_topic"`
	HeadOverdueSeconds float64 `json:"head_overdue_seconds"`
	OldestAgeSeconds   float64 `json:"oldest_age_seconds"`
	HeadAttempt        int     `json:"head_attempt"`
	HeadError          string  `json:"head_error"`
}

// ParkedGroup sums up one group's parked keys.
type ParkedGroup struct {
	ConsumerGroup         string  `json:"consumer_group"`
	Keys                  int64   `json:"keys"`
	Events                int64   `json:"events"`
	MaxQueue              int64   `json:"max_queue"`
	OldestAgeSeconds      float64 `json:"oldest_age_seconds"`
	MaxHeadOverdueSeconds float64 `json:"max_head_overdue_seconds"`
}

// ToParked is the JSON shape of a summary and keys.
func ToParked(sum []parkedsql.Summary, keys []parkedsql.Key) Parked {
	out := Parked{[]ParkedGroup{}, []ParkedKey{}}
	for _, s := range sum {
		out.Groups = append(out.Groups, ParkedGroup{s.ConsumerGroup, s.Keys, s.Events, s.MaxQueue, s.OldestAge.Seconds(), s.MaxHeadOverdue.Seconds()})
	}
	for _, k := range keys {
		out.Keys = append(out.Keys, ParkedKey{k.ConsumerGroup, k.Key, k.Events, k.Head.String(), k.HeadTopic, k.HeadOverdue.Seconds(), k.OldestAge.Seconds(), k.HeadAttempt, k.HeadError})
	}
	return out
}

// Backlog is outbox backlog --json, and the outbox part of the console's
// overview.
type Backlog struct {
	Forwarder string         `json:"forwarder"`
	Topics    []BacklogTopic `json:"topics"`
}

// BacklogTopic is one topic's backlog.
type BacklogTopic struct {
	Topic            string  `json:"topic"`
	Pending          int64   `json:"pending"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	Dead             int64   `json:"dead"`
}

// ToBacklog is the JSON shape of forwarder's backlog bl.
func ToBacklog(forwarder string, bl []outbox.Backlog) Backlog {
	out := Backlog{Forwarder: forwarder, Topics: []BacklogTopic{}}
	for _, b := range bl {
		out.Topics = append(out.Topics, BacklogTopic{b.Topic, b.Pending, b.OldestAge.Seconds(), b.Dead})
	}
	return out
}

// Partition is a partition in JSON output.
type Partition struct {
	Name    string `json:"name"`
	Default bool   `json:"default"`
	From    Time   `json:"from"`
	To      Time   `json:"to"`
	Bound   string `json:"bound"`
	Bytes   int64  `json:"bytes"`
}

// ToPartition is p's JSON shape.
func ToPartition(p partition.Info) Partition {
	return Partition{p.Name, p.Default, Time(p.From), Time(p.To), p.Bound, p.Bytes}
}
