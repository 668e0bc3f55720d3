package parallel_test

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
)

// Cooperative-sticky is accepted on both paths Sarama reads (the
// deprecated Strategy field first), with Sarama's own rule that it needs
// Version 2.4.
func TestSubscriberAcceptsCooperative(t *testing.T) {
	for name, mod := range map[string]func(*sarama.Config){
		"GroupStrategies": func(c *sarama.Config) {
			c.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
		},
		"deprecated Strategy over an eager GroupStrategies": func(c *sarama.Config) {
			c.Consumer.Group.Rebalance.Strategy = sarama.NewBalanceStrategyCooperativeSticky()
		},
	} {
		t.Run(name, func(t *testing.T) {
			sc := sarama.NewConfig()
			sc.Version = sarama.V2_4_0_0
			mod(sc)
			cfg := parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: []string{"127.0.0.1:1"}, Sarama: sc}, ConsumerGroup: "g"}
			_, err := parallel.NewSubscriber(cfg, nil)
			require.NoError(t, err)
			sc.Version = sarama.V2_1_0_0
			_, err = parallel.NewSubscriber(cfg, nil)
			require.ErrorContains(t, err, "parallel: invalid config: Client.Sarama: ")
			require.ErrorContains(t, err, "cooperative balance strategies require Version >= 2.4")
		})
	}
}

// RevokeTimeout leaves room, before the rebalance deadline, for the
// heartbeat that brings the news, the final commit and ReconnectRetrySleep;
// CommitMetadataMaxBytes stays within the brokers'
// offset.metadata.max.bytes, 4096 unless stated.
func TestSubscriberConfigMargins(t *testing.T) {
	base := func() parallel.SubscriberConfig {
		return parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: []string{"127.0.0.1:1"}}, ConsumerGroup: "g"}
	}
	for _, tc := range []struct {
		name  string
		mod   func(*parallel.SubscriberConfig)
		field string // "" when accepted
	}{
		{"RevokeTimeout below Rebalance.Timeout but not by the margin", func(c *parallel.SubscriberConfig) { c.Client.RevokeTimeout = 55 * time.Second }, "Client.RevokeTimeout"},
		{"RevokeTimeout within the margin", func(c *parallel.SubscriberConfig) { c.Client.RevokeTimeout = 50 * time.Second }, ""},
		{"a long ReconnectRetrySleep eats the margin", func(c *parallel.SubscriberConfig) {
			c.Client.RevokeTimeout = 50 * time.Second
			c.ReconnectRetrySleep = 10 * time.Second
		}, "Client.RevokeTimeout"},
		{"CommitMetadataMaxBytes above Kafka's default limit", func(c *parallel.SubscriberConfig) { c.CommitMetadataMaxBytes = 4097 }, "CommitMetadataMaxBytes"},
		{"CommitMetadataMaxBytes at Kafka's default limit", func(c *parallel.SubscriberConfig) { c.CommitMetadataMaxBytes = 4096 }, ""},
		{"CommitMetadataMaxBytes within a stated limit", func(c *parallel.SubscriberConfig) {
			c.CommitMetadataMaxBytes = 8000
			c.BrokerMetadataMaxBytes = 8192
		}, ""},
		{"CommitMetadataMaxBytes above a stated limit", func(c *parallel.SubscriberConfig) {
			c.CommitMetadataMaxBytes = 2048
			c.BrokerMetadataMaxBytes = 1024
		}, "CommitMetadataMaxBytes"},
		{"BrokerMetadataMaxBytes negative", func(c *parallel.SubscriberConfig) { c.BrokerMetadataMaxBytes = -1 }, "BrokerMetadataMaxBytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			tc.mod(&cfg)
			_, err := parallel.NewSubscriber(cfg, nil)
			if tc.field == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, "parallel: invalid config: "+tc.field+": ")
		})
	}
}

// A session that ends in a rebalance is followed by a join at once:
// ReconnectRetrySleep is for errors only. The first
// member's ReconnectRetrySleep is longer than the test's deadline.
func TestSubscriberRejoinsAtOnceAfterARebalance(t *testing.T) {
	f := newFixture(t, 2, 2)
	sc := sarama.NewConfig()
	sc.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	sc.Consumer.Group.Rebalance.Timeout = 20 * time.Minute
	cfg := f.config("rejoin")
	cfg.Client.Sarama = sc
	cfg.ReconnectRetrySleep = 10 * time.Minute
	subscribe := func() (*parallel.Subscriber, <-chan *message.Message) {
		sub := f.subscriber(t, cfg)
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
		ch, err := sub.Subscribe(ctx, f.topic)
		require.NoError(t, err)
		go func() {
			for m := range ch {
				m.Ack()
			}
		}()
		return sub, ch
	}
	a, _ := subscribe()
	waitFor(t, "the first member's session", func() bool { return len(a.Stats().Partitions) == 2 })
	b, _ := subscribe()
	waitFor(t, "a session for both members", func() bool {
		return a.Stats().Sessions == 2 && b.Stats().Sessions == 1 && len(a.Stats().Partitions) == 1 && len(b.Stats().Partitions) == 1
	})
}

// committed reads group's committed offset and metadata of partition 0.
func (f *fixture) committed(t *testing.T, group string) (int64, string) {
	t.Helper()
	admin := f.admin(t)
	defer admin.Close()
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{f.topic: {0}})
	require.NoError(t, err)
	b := resp.GetBlock(f.topic, 0)
	return b.Offset, b.Metadata
}

// The next owner starts at a record already done: the committed one was
// removed (DeleteRecords here; retention and compaction do the same), and
// the commit metadata lists the records after it as done. They are
// trimmed as they are read, so the committed offset moves past them, and a
// PartitionWindow smaller than the previous owner's (3 here, against 5
// done records) does not fill up with them and stall the partition.
func TestSubscriberTrimsRecordsDoneAtTheWindowStart(t *testing.T) {
	f := newFixture(t, 1, 4)
	a1, g := f.blockedHeadAndFive(t)
	cfg := f.config("trim")
	cfg.Client.RevokeTimeout = 100 * time.Millisecond
	sub := f.subscriber(t, cfg)
	stop := f.router(t, sub, f.db.Pool, 0, nil, ledgerHandler(func(ev event) error {
		if ev == a1 {
			<-g.ch(a1)
			return errors.New("abandoned")
		}
		return nil
	}))
	t.Cleanup(g.releaseAll)
	f.waitApplied(t, 5)
	waitFor(t, "the done offsets in the commit metadata", func() bool {
		off, meta := f.committed(t, "trim")
		return off == 0 && meta != ""
	})
	go func() {
		time.Sleep(200 * time.Millisecond) // past RevokeTimeout: a1 is abandoned
		g.release(a1)
	}()
	stop()

	// The committed record goes; five more events come.
	admin := f.admin(t)
	require.NoError(t, admin.DeleteRecords(f.topic, map[int32]int64{0: 1}))
	require.NoError(t, admin.Close())
	var more []*message.Message
	for i := 5; i < 11; i++ {
		more = append(more, f.event(t, keyName(i), 1))
	}
	require.NoError(t, f.pub.Publish(f.topic, more...))

	cfg2 := f.config("trim")
	cfg2.PartitionWindow = 3
	sub2 := f.subscriber(t, cfg2)
	f.router(t, sub2, f.db.Pool, 0, nil, ledgerHandler(nil))
	f.waitApplied(t, 11)
	waitFor(t, "the committed offset past every record", func() bool {
		off, meta := f.committed(t, "trim")
		return off == 12 && meta == ""
	})
	// The metadata is read as runs (up to PartitionWindow runs: one here),
	// so all 5 done records are skipped; only the 6 new ones run.
	require.Equal(t, uint64(5), sub2.Stats().Skipped)
	require.Equal(t, uint64(6), sub2.Stats().Acked)
	want := map[string]int{}
	for i := range 11 {
		want[keyName(i)] = 1
	}
	f.verifyLedgerKeys(t, want)
}

// brokerMetadataLimit is Kafka's default offset.metadata.max.bytes, which
// kfake does not enforce: refuseLongMetadata makes it.
const brokerMetadataLimit = 4096

// commitLog is what the in-process broker saw of the offset commits.
type commitLog struct {
	mu sync.Mutex
	// refused counts the commits refused; passedAfter holds the metadata
	// lengths of the commits that passed after the first refusal.
	refused     int
	passedAfter []int
}

func (l *commitLog) passedAfterRefusal() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]int(nil), l.passedAfter...)
}

// refuseLongMetadata makes the in-process broker refuse, as Kafka does, an
// offset commit whose metadata is longer than brokerMetadataLimit, and
// returns its log of the commits. A real cluster (KAFKA_BROKERS) refuses
// such a commit by itself; the log is nil then.
func refuseLongMetadata(f *fixture) *commitLog {
	c := f.broker.Fake
	if c == nil {
		return nil
	}
	l := &commitLog{}
	c.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		req := kreq.(*kmsg.OffsetCommitRequest)
		longest := 0
		for _, rt := range req.Topics {
			for _, rp := range rt.Partitions {
				if rp.Metadata != nil {
					longest = max(longest, len(*rp.Metadata))
				}
			}
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if longest <= brokerMetadataLimit {
			if l.refused > 0 {
				l.passedAfter = append(l.passedAfter, longest)
			}
			return nil, nil, false // committed as usual
		}
		l.refused++
		c.KeepControl()
		resp := req.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewOffsetCommitResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewOffsetCommitResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.OffsetMetadataTooLarge.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	return l
}

// A commit the broker refuses (its offset.metadata.max.bytes is below the
// commit metadata, because BrokerMetadataMaxBytes was stated wrong) is not
// silent: it is counted in Stats with the error, logged, and the
// Subscriber halves the metadata it writes until commits pass again.
func TestSubscriberSurfacesARefusedCommit(t *testing.T) {
	f := newFixture(t, 1, 1)
	log := refuseLongMetadata(f)
	// a1 first, held in flight; then b0, a2, b1, a3...: the b records are
	// done, the a records wait behind a1, so the done offsets form 1,600
	// runs, over 4 KB of metadata.
	const pairs = 1600
	msgs := []*sarama.ProducerMessage{{Topic: f.topic, Key: sarama.StringEncoder("a"), Value: sarama.StringEncoder("a1")}}
	for i := range pairs {
		msgs = append(msgs,
			&sarama.ProducerMessage{Topic: f.topic, Key: sarama.StringEncoder(keyName(i)), Value: sarama.StringEncoder("b")},
			&sarama.ProducerMessage{Topic: f.topic, Key: sarama.StringEncoder("a"), Value: sarama.StringEncoder("a")})
	}
	prod, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: f.broker.Addrs})
	require.NoError(t, err)
	require.NoError(t, prod.SendMessages(msgs))
	require.NoError(t, prod.Close())

	cfg := f.config("refused")
	cfg.PartitionWindow = 2*pairs + 1
	cfg.CommitMetadataMaxBytes = 8000
	cfg.BrokerMetadataMaxBytes = 8192 // wrong: the broker's is 4096
	sub := f.subscriber(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
	ch, err := sub.Subscribe(ctx, f.topic)
	require.NoError(t, err)
	var held *message.Message
	for range pairs + 1 {
		m := <-ch
		if key, _ := kafka.MessageKeyFromCtx(m.Context()); string(key) == "a" {
			held = m // a1: never acked, so offset 0 stays the committed one
			continue
		}
		m.Ack()
	}
	require.NotNil(t, held)
	t.Cleanup(func() { held.Ack() })

	waitFor(t, "a refused commit in Stats", func() bool { return sub.Stats().CommitsRefused > 0 })
	require.ErrorIs(t, sub.Stats().LastCommitRefusal, sarama.ErrOffsetMetadataTooLarge)
	if log == nil {
		return // a real cluster: what passed after the refusal is not seen
	}
	// Every commit has the same done set from here on (a1 is held), so
	// only a halved metadata can pass.
	waitFor(t, "a commit with metadata to pass after the refusal", func() bool {
		for _, n := range log.passedAfterRefusal() {
			if n > 0 {
				return true
			}
		}
		return false
	})
	_, meta := f.committed(t, "refused")
	require.NotEmpty(t, meta)
	require.LessOrEqual(t, len(meta), brokerMetadataLimit)
}

// A revoked partition's window is released at once: the timers of its held
// (NotBeforeFunc) and backing-off (nacked) records are stopped, so they no
// longer keep the records, payloads included, until they fire, an hour
// later here. The first member's records become
// unreachable after a second member joins and the group rebalances.
func TestSubscriberReleasesARevokedWindow(t *testing.T) {
	const n = 20
	for _, tc := range []struct {
		name string
		// waiting is whether the first session's n records wait on their
		// timers.
		waiting func(parallel.SubscriberStats) bool
		// settled is whether the n records wait again after the rebalance,
		// across both members.
		settled  func(a, b parallel.SubscriberStats) bool
		notUntil time.Duration // what NotBeforeFunc holds a record for
		nackFor  time.Duration // NackResendSleep
	}{
		{"held", func(s parallel.SubscriberStats) bool { return s.Held == n },
			func(a, b parallel.SubscriberStats) bool { return a.Held+b.Held == n }, time.Hour, 10 * time.Millisecond},
		{"backing off", func(s parallel.SubscriberStats) bool { return s.Nacked == n },
			func(a, b parallel.SubscriberStats) bool { return a.Nacked+b.Nacked == 2*n }, 0, time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, 2, 1)
			var msgs []*message.Message
			for i := range n {
				msgs = append(msgs, f.event(t, keyName(i), 1))
			}
			require.NoError(t, f.pub.Publish(f.topic, msgs...))

			var mu sync.Mutex
			tracking := true
			var first []weak.Pointer[sarama.ConsumerMessage] // the records of the first session
			cfg := f.config("release")
			cfg.NackResendSleep = tc.nackFor
			cfg.NotBeforeFunc = func(m *sarama.ConsumerMessage) time.Time {
				mu.Lock()
				defer mu.Unlock()
				if tracking {
					first = append(first, weak.Make(m))
				}
				if tc.notUntil == 0 {
					return time.Time{}
				}
				return time.Now().Add(tc.notUntil)
			}
			subscribe := func() *parallel.Subscriber {
				sub := f.subscriber(t, cfg)
				ctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
				ch, err := sub.Subscribe(ctx, f.topic)
				require.NoError(t, err)
				go func() {
					for m := range ch {
						m.Nack() // to back off
					}
				}()
				return sub
			}
			a := subscribe()
			waitFor(t, "every record waiting on its timer", func() bool { return tc.waiting(a.Stats()) })
			mu.Lock()
			tracking = false
			require.Len(t, first, n)
			mu.Unlock()

			b := subscribe()
			waitFor(t, "the rebalance, and every record waiting again", func() bool {
				sa, sb := a.Stats(), b.Stats()
				return sa.Sessions == 2 && sb.Sessions == 1 && tc.settled(sa, sb)
			})
			waitFor(t, "the first session's records to be collected", func() bool {
				runtime.GC()
				for _, w := range first {
					if w.Value() != nil {
						return false
					}
				}
				return true
			})
		})
	}
}
