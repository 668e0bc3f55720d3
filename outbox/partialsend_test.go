package outbox_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

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
