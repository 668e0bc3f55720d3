// Package statsx holds what the metric exporters (middleware/idemprom,
// middleware/idemotel) share: the dedup counters and the idemkafka
// subscribers' stats summed per consumer group, and the backlog options
// they label with.
package statsx

import (
	"sort"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// GroupStats is one consumer group's counters, summed over its middlewares.
type GroupStats struct {
	Group string
	Stats idem.Stats
}

// ByGroup sums the middlewares' Stats per consumer group, in the order the
// groups first appear.
func ByGroup(dedups []*idem.Dedup) []GroupStats {
	var out []GroupStats
	index := map[string]int{}
	for _, d := range dedups {
		g := d.Deduplicator().Config().ConsumerGroup
		i, ok := index[g]
		if !ok {
			index[g] = len(out)
			out = append(out, GroupStats{Group: g, Stats: d.Stats()})
			continue
		}
		out[i].Stats = out[i].Stats.Add(d.Stats())
	}
	return out
}

// SubscriberGroup is one consumer group's idemkafka subscribers, their
// Stats summed: counters and gauges added, partitions of the same topic and
// number merged (distance and window added), sorted by topic and partition.
type SubscriberGroup struct {
	Group       string
	MaxInFlight int
	Stats       idemkafka.SubscriberStats
}

// SubscribersByGroup sums the subscribers' Stats per consumer group, in
// the order the groups first appear.
func SubscribersByGroup(subs []*idemkafka.Subscriber) []SubscriberGroup {
	var out []SubscriberGroup
	index := map[string]int{}
	type pkey struct {
		topic string
		part  int32
	}
	parts := map[string]map[pkey]int{}
	for _, sub := range subs {
		g := sub.ConsumerGroup()
		i, ok := index[g]
		if !ok {
			i = len(out)
			index[g] = i
			out = append(out, SubscriberGroup{Group: g})
			parts[g] = map[pkey]int{}
		}
		s := sub.Stats()
		o := &out[i]
		o.MaxInFlight += sub.MaxInFlight()
		o.Stats.InFlight += s.InFlight
		o.Stats.KeysWaiting += s.KeysWaiting
		o.Stats.Held += s.Held
		o.Stats.Acked += s.Acked
		o.Stats.Nacked += s.Nacked
		o.Stats.Skipped += s.Skipped
		o.Stats.Sessions += s.Sessions
		for _, p := range s.Partitions {
			k := pkey{p.Topic, p.Partition}
			if j, ok := parts[g][k]; ok {
				o.Stats.Partitions[j].Distance += p.Distance
				o.Stats.Partitions[j].Window += p.Window
				continue
			}
			parts[g][k] = len(o.Stats.Partitions)
			o.Stats.Partitions = append(o.Stats.Partitions, p)
		}
	}
	for i := range out {
		ps := out[i].Stats.Partitions
		sort.Slice(ps, func(a, b int) bool {
			if ps[a].Topic != ps[b].Topic {
				return ps[a].Topic < ps[b].Topic
			}
			return ps[a].Partition < ps[b].Partition
		})
	}
	return out
}

// BacklogOpts returns a copy of opts (nil: the zero value) whose Forwarder
// is set (outbox.DefaultForwarderName when empty): the value the exporters
// keep and label the backlog gauges with.
func BacklogOpts(opts *outbox.BacklogOpts) outbox.BacklogOpts {
	var o outbox.BacklogOpts
	if opts != nil {
		o = *opts
		o.Topics = append([]string(nil), opts.Topics...)
	}
	if o.Forwarder == "" {
		o.Forwarder = outbox.DefaultForwarderName
	}
	return o
}
