// Package claimstart records, for this process, the offset each Kafka claim
// of a watermill-kafka subscriber started from (the group's committed
// offset when the claim began), so that the dedup middleware can compare
// where the subscriber started with the position PostgreSQL holds
// (DESIGN §12) instead of guessing it from the first record's offset.
//
// The first record's offset is not where the subscriber started: a topic
// written in Kafka transactions (the outbox forwarder's) holds a commit
// marker after each transaction's records, and records of aborted
// transactions are skipped, so offsets jump by one or more where nothing
// was lost. The claim's start has no such gaps: it is the offset the
// group committed, which the subscriber marks as the last record + 1, as
// the middleware records PostgreSQL's position.
//
// idemkafka.WatermillSubscriberConfig's handler records each claim; a
// subscriber configured otherwise records none, and the middleware falls
// back to the first record's offset. A claim of a subscriber that keeps
// the positions itself (idemkafka.ClientConfig.Progress) is recorded as
// Kept: the middleware then neither writes nor compares any.
package claimstart

import "sync"

// Start is where a claim began, and the claim's number in this process:
// a new claim of the same partition (a rebalance gave it back) has a new
// one.
type Start struct {
	Offset int64
	Claim  uint64
	// Kept: the subscriber keeps the partition's position in PostgreSQL
	// itself.
	Kept bool
}

type part struct {
	topic     string
	partition int32
}

var (
	mu     sync.RWMutex
	claims uint64
	// starts holds each partition's latest claim per Kafka group.
	starts = map[part]map[string]Start{}
)

// Record notes that group's claim of topic/partition starts at offset,
// and whether the subscriber keeps its position itself.
func Record(group, topic string, partition int32, offset int64, kept bool) {
	mu.Lock()
	defer mu.Unlock()
	claims++
	p := part{topic, partition}
	if starts[p] == nil {
		starts[p] = map[string]Start{}
	}
	starts[p][group] = Start{Offset: offset, Claim: claims, Kept: kept}
}

// Lookup returns the start of group's latest claim of topic/partition in
// this process, or false when none was recorded. The Kafka consumer group
// need not be named group (a retry topic's subscriber often has a group of
// its own while its dedup middleware keeps the main one): when none is,
// the claim of the one Kafka group that holds topic/partition here is
// taken; with several, none is (which one the message came from is not
// known).
func Lookup(group, topic string, partition int32) (Start, bool) {
	mu.RLock()
	defer mu.RUnlock()
	groups := starts[part{topic, partition}]
	if s, ok := groups[group]; ok {
		return s, true
	}
	if len(groups) != 1 {
		return Start{}, false
	}
	var only Start
	for _, s := range groups {
		only = s
	}
	return only, true
}
