package outbox_test

import (
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// The forwarder on franz-go's transactional producer (franz.SyncProducer)
// keeps each key in order through a partial send failure, as on Sarama's:
// record A of key k fails while B of k is written, the page's transaction
// is aborted and sent again whole, and the read_committed dedup consumer
// applies A before B.
func TestForwarder_FranzTransactionalProducerKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	topic := e.topic(t, "franz-partial", 1)
	const perKey = 5
	keys := []string{"k", "j", "m"}
	var msgs []*message.Message
	for seq := range perKey {
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
	e.service(t, topic, "franz-partial", "", func(m *message.Message) ([]*message.Message, error) {
		p := decode(t, string(m.Payload))
		mu.Lock()
		defer mu.Unlock()
		applied[p.Aggregate] = append(applied[p.Aggregate], p.Seq)
		count++
		return nil, nil
	})

	real, err := franz.NewSyncProducer(franz.PublisherConfig{Brokers: e.broker.Addrs, TransactionalID: "franz-forwarder-" + topic})
	require.NoError(t, err)
	t.Cleanup(func() { _ = real.Close() })
	require.True(t, real.IsTransactional())
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
	require.Equal(t, sarama.ProducerTxnFlagReady, real.TxnStatus())
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		require.Equal(t, []int{0, 1, 2, 3, 4}, applied[k], "key %s applied in order", k)
	}
}
