package idemkafka

import "sort"

// counters are the Subscriber's numbers, guarded by its mu.
type counters struct {
	inflight, waiting, held          int
	acked, nacked, skipped, sessions uint64
}

// SubscriberStats is a snapshot of a [Subscriber]'s work.
type SubscriberStats struct {
	// InFlight is the number of messages handed out and not yet acked or
	// nacked (at most MaxInFlight).
	InFlight int
	// KeysWaiting is the number of records waiting for an earlier message
	// of their key (with OrderPartition: of their partition).
	KeysWaiting int
	// Held is the number of records waiting for their NotBeforeFunc time.
	Held int
	// Acked and Nacked count the acks and nacks since NewSubscriber.
	Acked, Nacked uint64
	// Skipped counts the records not handed out because the commit
	// metadata recorded them done before a restart or rebalance.
	Skipped uint64
	// Sessions counts the consumer-group sessions set up (the first join,
	// then one per rebalance), across every Subscribe call.
	Sessions uint64
	// Partitions are the partitions this Subscriber holds now.
	Partitions []PartitionStats
}

// PartitionStats is one held partition.
type PartitionStats struct {
	Topic     string
	Partition int32
	// Committed is the offset below which every record is done (the one
	// marked for commit), -1 before the first record.
	Committed int64
	// HighestHandedOut is the highest offset handed out, -1 for none.
	HighestHandedOut int64
	// Distance is HighestHandedOut+1-Committed (0 when nothing handed out
	// is pending): how far processing runs ahead of the committed offset,
	// which bounds the records a crash could make run again.
	Distance int64
	// Window is the number of records held from Committed on.
	Window int
}

// ConsumerGroup is the Kafka consumer group of the Subscriber
// (SubscriberConfig.ConsumerGroup), the label of its exported metrics.
func (s *Subscriber) ConsumerGroup() string { return s.cfg.ConsumerGroup }

// Stats returns a snapshot.
func (s *Subscriber) Stats() SubscriberStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := SubscriberStats{
		InFlight: s.stats.inflight, KeysWaiting: s.stats.waiting, Held: s.stats.held,
		Acked: s.stats.acked, Nacked: s.stats.nacked, Skipped: s.stats.skipped, Sessions: s.stats.sessions,
	}
	for st := range s.streams {
		for _, p := range st.parts {
			committed := p.commitOffset()
			ps := PartitionStats{Topic: st.topic, Partition: p.partition, Committed: committed, HighestHandedOut: p.highest, Window: len(p.window)}
			if committed < 0 {
				ps.Committed = -1
			}
			if p.highest >= committed && committed >= 0 {
				ps.Distance = p.highest + 1 - committed
			}
			out.Partitions = append(out.Partitions, ps)
		}
	}
	sort.Slice(out.Partitions, func(i, j int) bool {
		a, b := out.Partitions[i], out.Partitions[j]
		if a.Topic != b.Topic {
			return a.Topic < b.Topic
		}
		return a.Partition < b.Partition
	})
	return out
}
