package conformance_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// keyed is the seq-th message of key.
func keyed(key string, seq int) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(seq)))
	m.Metadata.Set(publisher.MetadataPartitionKey, key)
	m.Metadata.Set("seq", strconv.Itoa(seq))
	return m
}

// publishInterleaved publishes seqs 1..perKey of each of keys keys,
// interleaved, with e's publisher.
func publishInterleaved(t *testing.T, e engine, b *kafkatest.Broker, topic string, keys, perKey int) {
	t.Helper()
	var msgs []*message.Message
	for seq := 1; seq <= perKey; seq++ {
		for k := range keys {
			msgs = append(msgs, keyed(fmt.Sprintf("k%02d", k), seq))
		}
	}
	require.NoError(t, e.pub(t, b.Addrs).Publish(topic, msgs...))
}

// orderLedger checks the key-order rule across attempts and members: an
// attempt of a key's seq n starts only once seq n-1 was acked.
type orderLedger struct {
	mu         sync.Mutex
	acked      map[string]int // key → highest seq acked
	violations []string
	acks       int
}

func newOrderLedger() *orderLedger { return &orderLedger{acked: map[string]int{}} }

func (l *orderLedger) start(msg *message.Message) (key string, seq int) {
	key = msg.Metadata.Get(publisher.MetadataPartitionKey)
	seq, _ = strconv.Atoi(msg.Metadata.Get("seq"))
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.acked[key] < seq-1 {
		l.violations = append(l.violations, fmt.Sprintf("%s seq %d started before seq %d was acked", key, seq, seq-1))
	}
	return key, seq
}

func (l *orderLedger) ack(msg *message.Message, key string, seq int) {
	l.mu.Lock()
	l.acked[key] = max(l.acked[key], seq)
	l.acks++
	l.mu.Unlock()
	msg.Ack()
}

// complete reports whether every key of keys acked perKey.
func (l *orderLedger) complete(keys, perKey int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for k := range keys {
		if l.acked[fmt.Sprintf("k%02d", k)] < perKey {
			return false
		}
	}
	return true
}

// consume runs handle on each message of sub's topic in a goroutine of its
// own (as a router with many handlers would) until the test ends.
func consume(t *testing.T, sub message.Subscriber, topic string, handle func(*message.Message)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	go func() {
		for msg := range ch {
			go handle(msg)
		}
	}()
}

// TestKeyOrderUnderNacks: messages of different keys run at once, each
// key's in order, through nacks (every third seq fails its first attempt).
func TestKeyOrderUnderNacks(t *testing.T) {
	b := kafkatest.Start(t)
	forEach(t, func(t *testing.T, e engine) {
		topic := b.Topic(t, "order", 4)
		const keys, perKey = 12, 10
		publishInterleaved(t, e, b, topic, keys, perKey)
		l := newOrderLedger()
		var mu sync.Mutex
		failed := map[string]bool{}
		sub := e.sub(t, b.Addrs, "order-"+e.name, subOpts{revokeTimeout: time.Second})
		consume(t, sub, topic, func(msg *message.Message) {
			key, seq := l.start(msg)
			time.Sleep(time.Millisecond)
			mu.Lock()
			first := !failed[msg.UUID]
			failed[msg.UUID] = true
			mu.Unlock()
			if seq%3 == 0 && first {
				msg.Nack()
				return
			}
			l.ack(msg, key, seq)
		})
		wait(t, "every key acked to its last seq", func() bool { return l.complete(keys, perKey) })
		l.mu.Lock()
		defer l.mu.Unlock()
		require.Empty(t, l.violations)
	})
}

// committed is group's committed offset of topic's partition, -1 for none.
func committed(t *testing.T, b *kafkatest.Broker, group, topic string, partition int32) int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs...))
	require.NoError(t, err)
	defer cl.Close()
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = group
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic = topic
	rt.Partitions = []int32{partition}
	req.Topics = []kmsg.OffsetFetchRequestTopic{rt}
	resp, err := req.RequestWith(context.Background(), cl)
	require.NoError(t, err)
	require.NoError(t, kerr.ErrorForCode(resp.ErrorCode))
	for _, tt := range resp.Topics {
		for _, p := range tt.Partitions {
			if tt.Topic == topic && p.Partition == partition {
				require.NoError(t, kerr.ErrorForCode(p.ErrorCode))
				return p.Offset
			}
		}
	}
	return -1
}

// TestFailingKeyHoldsOnlyItsOffset: a key whose head keeps failing holds
// neither the other keys of its partition nor more than the committed
// offset: it stays at the failing record until it is acked, then moves to
// the end.
func TestFailingKeyHoldsOnlyItsOffset(t *testing.T) {
	b := kafkatest.Start(t)
	forEach(t, func(t *testing.T, e engine) {
		topic := b.Topic(t, "hol", 1)
		msgs := []*message.Message{keyed("bad", 1)}
		for i := range 30 {
			msgs = append(msgs, keyed(fmt.Sprintf("k%02d", i%6), i/6+1))
		}
		msgs = append(msgs, keyed("bad", 2), keyed("bad", 3))
		require.NoError(t, e.pub(t, b.Addrs).Publish(topic, msgs...))
		group := "hol-" + e.name
		l := newOrderLedger()
		release := make(chan struct{})
		handle := func(msg *message.Message) {
			key, seq := l.start(msg)
			if key == "bad" && seq == 1 {
				select {
				case <-release:
				default:
					msg.Nack()
					return
				}
			}
			l.ack(msg, key, seq)
		}
		sub := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second})
		consume(t, sub, topic, handle)
		wait(t, "the other keys of the partition acked", func() bool { return l.complete(6, 5) })
		// Close commits at once: the committed offset must not pass the
		// failing record, the first of the partition.
		require.NoError(t, sub.Close())
		require.LessOrEqual(t, committed(t, b, group, topic, 0), int64(0), "the committed offset passed a record not acked")
		close(release)
		again := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second})
		consume(t, again, topic, handle)
		wait(t, "the committed offset at the end", func() bool { return committed(t, b, group, topic, 0) == int64(len(msgs)) })
		l.mu.Lock()
		defer l.mu.Unlock()
		require.Empty(t, l.violations)
		require.Equal(t, 3, l.acked["bad"])
	})
}

// TestRevokedMessagesGoToTheNextOwner: when a member joins, the partitions
// that move are revoked from the first; their messages still in flight
// after RevokeTimeout are abandoned (their contexts cancelled) before the
// new owner gets them again.
func TestRevokedMessagesGoToTheNextOwner(t *testing.T) {
	b := kafkatest.Start(t)
	forEach(t, func(t *testing.T, e engine) {
		topic := b.Topic(t, "revoke", 2)
		const keys = 10
		publishInterleaved(t, e, b, topic, keys, 1)
		group := "revoke-" + e.name
		var mu sync.Mutex
		held := map[string]context.Context{}
		var lateOrMissing []string
		movedTo := 0
		a := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second})
		consume(t, a, topic, func(msg *message.Message) {
			mu.Lock()
			held[msg.UUID] = msg.Context()
			mu.Unlock()
			<-msg.Context().Done()
			msg.Nack()
		})
		wait(t, "the first member holds every message", func() bool { mu.Lock(); defer mu.Unlock(); return len(held) == keys })
		bsub := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second})
		consume(t, bsub, topic, func(msg *message.Message) {
			mu.Lock()
			if ctx, ok := held[msg.UUID]; !ok || ctx.Err() == nil {
				lateOrMissing = append(lateOrMissing, msg.UUID)
			}
			movedTo++
			mu.Unlock()
			msg.Ack()
		})
		wait(t, "the second member got a partition's messages", func() bool { mu.Lock(); defer mu.Unlock(); return movedTo > 0 })
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, lateOrMissing, "a message reached the new owner while the old one still held it")
	})
}

// TestMembersJoinAndLeave: keys stay in order while a member joins and
// the first leaves, and every message is acked.
func TestMembersJoinAndLeave(t *testing.T) {
	b := kafkatest.Start(t)
	forEach(t, func(t *testing.T, e engine) {
		topic := b.Topic(t, "members", 4)
		const keys, perKey = 8, 40
		publishInterleaved(t, e, b, topic, keys, perKey)
		group := "members-" + e.name
		l := newOrderLedger()
		var secondGot atomic.Int32
		handler := func(second bool) func(*message.Message) {
			return func(msg *message.Message) {
				key, seq := l.start(msg)
				if second {
					secondGot.Add(1)
				}
				time.Sleep(5 * time.Millisecond)
				l.ack(msg, key, seq)
			}
		}
		acks := func() int { l.mu.Lock(); defer l.mu.Unlock(); return l.acks }
		first := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second, maxInFlight: 4})
		consume(t, first, topic, handler(false))
		wait(t, "the first member acked some", func() bool { return acks() >= 40 })
		second := e.sub(t, b.Addrs, group, subOpts{revokeTimeout: time.Second, maxInFlight: 4})
		consume(t, second, topic, handler(true))
		wait(t, "more acked", func() bool { return acks() >= 120 })
		require.NoError(t, first.Close())
		wait(t, "every key acked to its last seq", func() bool { return l.complete(keys, perKey) })
		l.mu.Lock()
		defer l.mu.Unlock()
		require.Empty(t, l.violations)
		require.Positive(t, secondGot.Load(), "the second member got no partition")
	})
}
