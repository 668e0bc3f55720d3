// Package statsx holds what the metric exporters (components/idemprom,
// components/idemotel) share: the dedup counters summed per consumer group,
// and the backlog options they label with.
package statsx

import (
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
