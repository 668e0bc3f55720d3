package idemotel

import (
	"sort"

	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// subscriberSum is one consumer group's idemkafka subscribers: their
// MaxInFlight and Stats summed.
type subscriberSum struct {
	MaxInFlight int
	Stats       idemkafka.SubscriberStats
}

// subscriberValue is sub's MaxInFlight and Stats, partitions sorted by
// topic and partition.
func subscriberValue(sub *idemkafka.Subscriber) subscriberSum {
	s := sub.Stats()
	sortPartitions(s.Partitions)
	return subscriberSum{MaxInFlight: sub.MaxInFlight(), Stats: s}
}

// addSubscribers adds b to a: counters and gauges added, partitions of the
// same topic and number merged (distance and window added), sorted by
// topic and partition.
func addSubscribers(a, b subscriberSum) subscriberSum {
	a.MaxInFlight += b.MaxInFlight
	a.Stats.InFlight += b.Stats.InFlight
	a.Stats.KeysWaiting += b.Stats.KeysWaiting
	a.Stats.Held += b.Stats.Held
	a.Stats.Acked += b.Stats.Acked
	a.Stats.Nacked += b.Stats.Nacked
	a.Stats.Skipped += b.Stats.Skipped
	a.Stats.Sessions += b.Stats.Sessions
	parts := append([]idemkafka.PartitionStats(nil), a.Stats.Partitions...)
next:
	for _, p := range b.Stats.Partitions {
		for i := range parts {
			if parts[i].Topic == p.Topic && parts[i].Partition == p.Partition {
				parts[i].Distance += p.Distance
				parts[i].Window += p.Window
				continue next
			}
		}
		parts = append(parts, p)
	}
	sortPartitions(parts)
	a.Stats.Partitions = parts
	return a
}

func sortPartitions(ps []idemkafka.PartitionStats) {
	sort.Slice(ps, func(a, b int) bool {
		if ps[a].Topic != ps[b].Topic {
			return ps[a].Topic < ps[b].Topic
		}
		return ps[a].Partition < ps[b].Partition
	})
}
