package parallel

import (
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// counters are the Subscriber's numbers, guarded by its mu.
type counters struct {
	inflight, held                   int
	keys                             keywindow.Counts // the windows' waiting and spilled records
	acked, nacked, skipped, sessions uint64
	refetched                        uint64
	commitsRefused                   uint64
	lastCommitRefusal                error
}

// SubscriberStats is a snapshot of a [Subscriber]'s work.
type SubscriberStats struct {
	// InFlight is the number of messages handed out and not yet acked or
	// nacked (at most MaxInFlight).
	InFlight int
	// MaxInFlight is the Subscriber's [SubscriberConfig.MaxInFlight].
	MaxInFlight int
	// KeysWaiting is the number of records waiting for an earlier message
	// of their key (with OrderPartition: of their partition).
	KeysWaiting int
	// Held is the number of records waiting for their NotBeforeFunc time.
	Held int
	// Spilled is the number of the KeysWaiting records whose payload was
	// dropped to make room in a full window: they are read again from
	// Kafka when they become their key's head (at most 64 ×
	// PartitionWindow per partition).
	Spilled int
	// Refetched counts the spilled records read again from Kafka (each
	// was read twice): with Spilled, what a blocked key's backlog costs.
	Refetched uint64
	// Acked and Nacked count the acks and nacks since NewSubscriber.
	Acked, Nacked uint64
	// Skipped counts the records not handed out because the commit
	// metadata recorded them done before a restart or rebalance.
	Skipped uint64
	// Sessions counts the consumer-group sessions set up (the first join,
	// then one per rebalance under an eager strategy; under
	// cooperative-sticky a session lives across rebalances), across every
	// Subscribe call.
	Sessions uint64
	// CommitsRefused counts the offset commits the broker refused for a
	// partition (OffsetMetadataTooLarge, InvalidCommitOffsetSize): while
	// they are refused the committed offset does not move. Each is logged;
	// on OffsetMetadataTooLarge the Subscriber halves the commit metadata
	// it writes for the topic (see
	// [SubscriberConfig].BrokerMetadataMaxBytes).
	CommitsRefused uint64
	// LastCommitRefusal is the last of them (a *sarama.ConsumerError
	// naming the partition), nil for none.
	LastCommitRefusal error
	// StalledKeys is the number of keys whose head record has waited
	// StallTimeout or longer without an ack (see
	// [SubscriberConfig].StallTimeout).
	StalledKeys int
	// Stalls are those keys, the longest stalled first, at most
	// maxStallsListed (100) of them.
	Stalls []Stall
	// Partitions are the partitions this Subscriber holds now.
	Partitions []PartitionStats
}

// StallCause is why a stalled key's head is not done.
type StallCause string

const (
	// StallFailing: the head was nacked (its handler failed) and runs
	// again after NackResendSleep, or cannot be unmarshalled.
	StallFailing StallCause = "failing"
	// StallSlow: the head's handler has been running StallTimeout or
	// longer.
	StallSlow StallCause = "slow"
	// StallQueued: the head waits for a MaxInFlight slot (every slot
	// taken, by other partitions or long handlers).
	StallQueued StallCause = "queued"
)

// Stall is a key whose head record (its first record not done) has waited
// StallTimeout or longer without an ack. The later records of the key wait
// behind it, and the committed offset of its partition stays at or below
// it; the other keys of the partition keep flowing.
type Stall struct {
	Topic     string
	Partition int32
	// Key is the record key (with OrderPartition and OrderNone, "").
	Key string
	// Offset is the head record's.
	Offset int64
	Cause  StallCause
	// For is how long since the record became its key's head.
	For time.Duration
	// Running is how long its current attempt's handler has run (0 when
	// not in flight).
	Running time.Duration
	// Nacks counts its nacks.
	Nacks int
	// LastError is the error of its last failed attempt: set when
	// [RecordErrors] is in the router (or it cannot be unmarshalled).
	LastError error
}

// maxStallsListed bounds SubscriberStats.Stalls.
const maxStallsListed = 100

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
	// Window is the number of records held from Committed on that are
	// not done (at most PartitionWindow).
	Window int
	// StalledFor is how long the partition has gone without an ack while
	// one of its keys is stalled, when that is StallTimeout or longer
	// (0 otherwise).
	StalledFor time.Duration
}

// ConsumerGroup is the Kafka consumer group of the Subscriber
// (SubscriberConfig.ConsumerGroup), the label of its exported metrics.
func (s *Subscriber) ConsumerGroup() string { return s.cfg.ConsumerGroup }

// Stats returns a snapshot.
func (s *Subscriber) Stats() SubscriberStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := SubscriberStats{
		InFlight: s.stats.inflight, MaxInFlight: s.cfg.MaxInFlight, KeysWaiting: s.stats.keys.Waiting, Held: s.stats.held, Spilled: s.stats.keys.Spilled, Refetched: s.stats.refetched,
		Acked: s.stats.acked, Nacked: s.stats.nacked, Skipped: s.stats.skipped, Sessions: s.stats.sessions,
		CommitsRefused: s.stats.commitsRefused, LastCommitRefusal: s.stats.lastCommitRefusal,
	}
	now := time.Now()
	for st := range s.streams {
		for _, p := range st.parts {
			committed := p.commitOffset()
			ps := PartitionStats{Topic: st.topic, Partition: p.partition, Committed: committed, HighestHandedOut: p.highest, Window: p.win.Undone()}
			stalls := p.stalls(now)
			out.StalledKeys += len(stalls)
			out.Stalls = append(out.Stalls, stalls...)
			if len(stalls) > 0 && now.Sub(p.progress) >= s.cfg.StallTimeout {
				ps.StalledFor = now.Sub(p.progress)
			}
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
	out.Stalls = longestStalls(out.Stalls)
	return out
}

// longestStalls sorts stalls, the longest first, and keeps
// maxStallsListed.
func longestStalls(stalls []Stall) []Stall {
	sort.SliceStable(stalls, func(i, j int) bool { return stalls[i].For > stalls[j].For })
	if len(stalls) > maxStallsListed {
		stalls = stalls[:maxStallsListed]
	}
	return stalls
}

// Add returns s plus o, for the stats of several Subscribers of one
// consumer group: counters and gauges added, the partitions of the same
// topic and number merged (Distance and Window added), sorted by topic and
// partition.
func (s SubscriberStats) Add(o SubscriberStats) SubscriberStats {
	s.InFlight += o.InFlight
	s.MaxInFlight += o.MaxInFlight
	s.KeysWaiting += o.KeysWaiting
	s.Held += o.Held
	s.Spilled += o.Spilled
	s.Acked += o.Acked
	s.Nacked += o.Nacked
	s.Skipped += o.Skipped
	s.Sessions += o.Sessions
	s.CommitsRefused += o.CommitsRefused
	s.StalledKeys += o.StalledKeys
	s.Stalls = longestStalls(append(append([]Stall(nil), s.Stalls...), o.Stalls...))
	if o.LastCommitRefusal != nil {
		s.LastCommitRefusal = o.LastCommitRefusal
	}
	parts := append([]PartitionStats(nil), s.Partitions...)
	for _, p := range o.Partitions {
		merged := false
		for i := range parts {
			if parts[i].Topic == p.Topic && parts[i].Partition == p.Partition {
				parts[i].Distance += p.Distance
				parts[i].Window += p.Window
				parts[i].StalledFor = max(parts[i].StalledFor, p.StalledFor)
				merged = true
				break
			}
		}
		if !merged {
			parts = append(parts, p)
		}
	}
	sort.Slice(parts, func(i, j int) bool {
		if parts[i].Topic != parts[j].Topic {
			return parts[i].Topic < parts[j].Topic
		}
		return parts[i].Partition < parts[j].Partition
	})
	s.Partitions = parts
	return s
}

// stalls are p's keys whose head has waited StallTimeout or longer
// without an ack. Called with mu held.
func (p *partState) stalls(now time.Time) []Stall {
	timeout := p.st.s.cfg.StallTimeout
	if timeout < 0 || p.stopping {
		return nil
	}
	var out []Stall
	for _, e := range p.win.Entries() {
		switch e.State {
		case keywindow.Ready, keywindow.InFlight, keywindow.Backoff, keywindow.Failed:
		default:
			continue // done, held, or behind its key's head
		}
		if e.head.IsZero() || now.Sub(e.head) < timeout {
			continue
		}
		st := Stall{Topic: p.st.topic, Partition: p.partition, Key: e.Key, Offset: e.Off, For: now.Sub(e.head), Nacks: e.nacks, LastError: e.lastErr}
		if e.State == keywindow.InFlight {
			st.Running = now.Sub(e.start)
		}
		switch {
		case st.Running >= timeout:
			st.Cause = StallSlow
		case e.nacks > 0 || e.State == keywindow.Failed:
			st.Cause = StallFailing
		default:
			st.Cause = StallQueued
		}
		out = append(out, st)
	}
	return out
}

// logStalls logs each key that stalled since the last call, once. Called
// without mu.
func (p *partState) logStalls() {
	s := p.st.s
	if s.cfg.StallTimeout < 0 {
		return
	}
	now := time.Now()
	s.mu.Lock()
	var fresh []Stall
	for _, st := range p.stalls(now) {
		e, ok := p.win.Find(st.Offset)
		if !ok || e.stalled {
			continue
		}
		e.stalled = true
		fresh = append(fresh, st)
	}
	s.mu.Unlock()
	for _, st := range fresh {
		fields := watermill.LogFields{
			"kafka_partition": st.Partition, "key": st.Key, "kafka_partition_offset": st.Offset, "cause": string(st.Cause),
			"stalled_for": st.For.Round(time.Millisecond).String(), "nacks": st.Nacks,
		}
		var err error
		switch st.Cause {
		case StallSlow:
			fields["running"] = st.Running.Round(time.Millisecond).String()
			err = fmt.Errorf("its handler running %.0f s", st.Running.Seconds())
		case StallFailing:
			err = st.LastError
			if err == nil {
				err = errors.New("nacked; add parallel.RecordErrors to the router to see the error")
			}
		default:
			err = errors.New("waiting for a MaxInFlight slot")
		}
		p.st.logger.Error("Key stalled ("+string(st.Cause)+"): its later records wait, the other keys of its partition flow", err, fields)
	}
}
