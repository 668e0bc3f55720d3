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
//
// The handler also hands each claim's start to the writers watching its
// Kafka group ([Watch]), before any of the claim's records reaches the
// router: the dedup middleware writes it as the partition's first position
// in PostgreSQL, so that a partition that consumed records always has a
// position there, even on a standby promoted after a replication cut. A
// Kept claim is handed to none (its subscriber writes that row itself).
package claimstart

import (
	"context"
	"sync"
)

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
	// watchers holds the writers of each Kafka group, by owner.
	watchers = map[string]map[string]StartFunc{}
)

// StartFunc writes where a claim of topic/partition starts.
type StartFunc func(ctx context.Context, topic string, partition int32, offset int64)

// Watch makes Record call fn for each claim of kafkaGroup, in place of the
// writer owner set before (the latest of an owner wins: a consumer built
// again replaces the earlier one's).
func Watch(kafkaGroup, owner string, fn StartFunc) {
	mu.Lock()
	defer mu.Unlock()
	if watchers[kafkaGroup] == nil {
		watchers[kafkaGroup] = map[string]StartFunc{}
	}
	watchers[kafkaGroup][owner] = fn
}

// Started records the claim (Record) and then, unless kept, calls the
// writers watching group, one after another, before it returns.
func Started(ctx context.Context, group, topic string, partition int32, offset int64, kept bool) {
	Record(group, topic, partition, offset, kept)
	if kept {
		return
	}
	mu.RLock()
	fns := make([]StartFunc, 0, len(watchers[group]))
	for _, fn := range watchers[group] {
		fns = append(fns, fn)
	}
	mu.RUnlock()
	for _, fn := range fns {
		fn(ctx, topic, partition, offset)
	}
}

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
