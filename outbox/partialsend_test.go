package outbox_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// failOne fails one record of the first send that holds it, as Sarama does
// when that record's leader lookup fails mid-election: the call returns a
// ProducerErrors naming it, while the page's other records, later records
// of the same key included, are written to the broker.
type failOne struct {
	sarama.SyncProducer
	match  func(*sarama.ProducerMessage) bool
	failed atomic.Bool
}

func (p *failOne) SendMessages(msgs []*sarama.ProducerMessage) error {
	if p.failed.Load() {
		return p.SyncProducer.SendMessages(msgs)
	}
	var (
		rest []*sarama.ProducerMessage
		errs sarama.ProducerErrors
	)
	for _, m := range msgs {
		if p.match(m) && p.failed.CompareAndSwap(false, true) {
			errs = append(errs, &sarama.ProducerError{Msg: m, Err: sarama.ErrLeaderNotAvailable})
			continue
		}
		rest = append(rest, m)
	}
	if err := p.SyncProducer.SendMessages(rest); err != nil {
		return err
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

// A page whose record A of key k fails while B of key k is written: with a
// transactional producer (idemkafka.ClientConfig.TransactionalID) the
// page is one Kafka transaction, aborted and sent again whole, and the
// dedup consumer (read_committed, as idemkafka's consumer configs read)
// applies A before B. The idempotent producer alone writes B, then A and B
// again: the consumer applies B first, which this test shows too.
func TestForwarder_PartialSendFailureKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		transactional bool
	}{{"transactional", true}, {"idempotent-only", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 8)
			topic := e.topic(t, "partial", 1)
			const perKey = 5
			keys := []string{"k", "j", "m"}
			var msgs []*message.Message
			for seq := 0; seq < perKey; seq++ {
				for _, k := range keys {
					msgs = append(msgs, event(k, seq))
				}
			}
			e.publishTx(t, topic, msgs...)

			var (
				mu      sync.Mutex
				applied = map[string][]int{}
				count   int
			)
			e.service(t, topic, "partial-"+tc.name, "", func(m *message.Message) ([]*message.Message, error) {
				p := decode(t, string(m.Payload))
				mu.Lock()
				defer mu.Unlock()
				applied[p.Aggregate] = append(applied[p.Aggregate], p.Seq)
				count++
				return nil, nil
			})

			cc := idemkafka.ClientConfig{Brokers: e.broker.Addrs}
			if tc.transactional {
				cc.TransactionalID = "forwarder-" + topic
			}
			real, err := idemkafka.NewSyncProducer(cc)
			require.NoError(t, err)
			t.Cleanup(func() { _ = real.Close() })
			prod := &failOne{SyncProducer: real, match: func(m *sarama.ProducerMessage) bool {
				v, _ := m.Value.Encode()
				return string(v) == `{"aggregate":"k","seq":0}`
			}}
			f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, Producer: prod, RetryInterval: 10 * time.Millisecond})

			require.Eventually(t, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return count == len(msgs)
			}, eventuallyTimeout, 10*time.Millisecond)
			require.True(t, prod.failed.Load(), "the record failed once")
			require.EqualValues(t, 1, f.Stats().Errors, "one failed send, then the page again")

			mu.Lock()
			defer mu.Unlock()
			if !tc.transactional {
				require.Equal(t, []int{1, 2, 3, 4, 0}, applied["k"], "without a transaction, the first copies of B, C, D, E come before A")
				return
			}
			for _, k := range keys {
				require.Equal(t, []int{0, 1, 2, 3, 4}, applied[k], "key %s applied in order", k)
			}
		})
	}
}

// A Kafka transaction whose commit fails past its retries (EndTxn refused
// by the coordinator, as while it moves) leaves Sarama's producer in
// "committing": every later BeginTxn is refused. The forwarder commits it
// again before its next transaction, so the topic goes on, in order.
func TestForwarder_FailedKafkaCommitDoesNotStopTheProducer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	topic := e.topic(t, "endtxn", 1)
	if e.broker.Fake == nil {
		t.Skip("needs the in-process broker to refuse EndTxn")
	}
	base := sarama.NewConfig()
	base.Producer.Transaction.Retry.Max = 1
	base.Producer.Transaction.Retry.Backoff = 10 * time.Millisecond
	prod, err := idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: e.broker.Addrs, Sarama: base, TransactionalID: "endtxn-" + topic})
	require.NoError(t, err)
	t.Cleanup(func() { _ = prod.Close() })

	// The first three EndTxn requests are refused with a retriable error:
	// the first commit (two attempts) fails and leaves the producer in
	// "committing".
	var refused atomic.Int32
	e.broker.Fake.ControlKey(int16(kmsg.EndTxn), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.broker.Fake.KeepControl()
		if refused.Add(1) > 3 {
			return nil, nil, false
		}
		resp := req.(*kmsg.EndTxnRequest).ResponseKind().(*kmsg.EndTxnResponse)
		resp.ErrorCode = kerr.ConcurrentTransactions.Code
		return resp, nil, true
	})

	const perKey = 5
	var msgs []*message.Message
	for seq := range perKey {
		for _, k := range []string{"k", "j"} {
			msgs = append(msgs, event(k, seq))
		}
	}
	e.publishTx(t, topic, msgs[:4]...)
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}, Producer: prod, RetryInterval: 10 * time.Millisecond})
	require.Eventually(t, func() bool { return f.Stats().Forwarded == 4 }, eventuallyTimeout, 10*time.Millisecond)
	e.publishTx(t, topic, msgs[4:]...)
	require.Eventually(t, func() bool { return f.Stats().Forwarded == uint64(len(msgs)) }, eventuallyTimeout, 10*time.Millisecond,
		"the forwarder goes on after a failed Kafka commit")
	require.Positive(t, f.Stats().Errors, "the failed commit failed a forwarder transaction")
	require.GreaterOrEqual(t, refused.Load(), int32(3))

	// Read committed, first copies: each key in order.
	cfg := idemkafka.SaramaConsumerConfig(nil)
	c, err := sarama.NewConsumer(e.broker.Addrs, cfg)
	require.NoError(t, err)
	defer c.Close()
	pc, err := c.ConsumePartition(topic, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	defer pc.Close()
	seen := map[string]bool{}
	next := map[string]int{}
	for len(seen) < len(msgs) {
		select {
		case m := <-pc.Messages():
			if seen[string(m.Value)] {
				continue // a copy
			}
			seen[string(m.Value)] = true
			p := decode(t, string(m.Value))
			require.Equal(t, next[p.Aggregate], p.Seq, "key %s in order", p.Aggregate)
			next[p.Aggregate]++
		case <-time.After(eventuallyTimeout):
			t.Fatalf("read %d of %d events", len(seen), len(msgs))
		}
	}
}
