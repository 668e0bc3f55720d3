package franz

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
)

// syncProducer is a Sarama SyncProducer on franz-go, for
// outbox.ForwarderConfig.Producer: the forwarder's Kafka writes on the
// franz-go engine with the forwarder unchanged. It implements what the
// forwarder calls (SendMessage(s), the transaction calls, TxnStatus,
// Close); the consumer-offset calls of Sarama's exactly-once
// read-process-write loop (AddOffsetsToTxn, AddMessageToTxn) return
// errOffsetsInTxn. [NewSyncProducer] creates it.
type syncProducer struct {
	cl            *kgo.Client
	transactional bool

	mu     sync.Mutex
	status sarama.ProducerTxnStatusFlag
	once   sync.Once
}

var _ sarama.SyncProducer = (*syncProducer)(nil)

// errOffsetsInTxn is what the consumer-offset calls return.
var errOffsetsInTxn = errors.New("franz: SyncProducer does not add consumer offsets to a transaction")

// NewSyncProducer validates cfg and returns a Sarama SyncProducer on
// franz-go for outbox.ForwarderConfig.Producer, transactional when
// cfg.TransactionalID is set: the forwarder then sends each page as one
// Kafka transaction, and a page with a failed record is aborted and sent
// again whole, so that read_committed consumers see each key in order. It
// implements what the forwarder calls (SendMessage(s), the transaction
// calls, TxnStatus, Close); the consumer-offset calls of Sarama's
// read-process-write loop (AddOffsetsToTxn, AddMessageToTxn) return an
// error.
func NewSyncProducer(cfg PublisherConfig) (sarama.SyncProducer, error) {
	cl, err := cfg.client()
	if err != nil {
		return nil, err
	}
	return &syncProducer{cl: cl, transactional: cfg.TransactionalID != "", status: sarama.ProducerTxnFlagReady}, nil
}

// SendMessage sends one record and returns where it was written.
func (p *syncProducer) SendMessage(msg *sarama.ProducerMessage) (int32, int64, error) {
	if err := p.SendMessages([]*sarama.ProducerMessage{msg}); err != nil {
		var perrs sarama.ProducerErrors
		if errors.As(err, &perrs) && len(perrs) == 1 {
			return -1, -1, perrs[0].Err
		}
		return -1, -1, err
	}
	return msg.Partition, msg.Offset, nil
}

// SendMessages sends msgs and returns when every one is written or
// failed; the failed ones come back as sarama.ProducerErrors. Inside a
// transaction a failure makes the transaction abortable.
func (p *syncProducer) SendMessages(msgs []*sarama.ProducerMessage) error {
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		r, err := fromSarama(m)
		if err != nil {
			return err
		}
		recs[i] = r
	}
	var perrs sarama.ProducerErrors
	for i, res := range p.cl.ProduceSync(context.Background(), recs...) {
		if res.Err != nil {
			perrs = append(perrs, &sarama.ProducerError{Msg: msgs[i], Err: res.Err})
			continue
		}
		msgs[i].Partition, msgs[i].Offset = res.Record.Partition, res.Record.Offset
	}
	if len(perrs) > 0 {
		p.mu.Lock()
		if p.status&sarama.ProducerTxnFlagInTransaction != 0 {
			p.status |= sarama.ProducerTxnFlagAbortableError
		}
		p.mu.Unlock()
		return perrs
	}
	return nil
}

// fromSarama is m as a franz-go record.
func fromSarama(m *sarama.ProducerMessage) (*kgo.Record, error) {
	r := &kgo.Record{Topic: m.Topic, Timestamp: m.Timestamp}
	var err error
	if m.Key != nil {
		if r.Key, err = m.Key.Encode(); err != nil {
			return nil, fmt.Errorf("franz: encode record key: %w", err)
		}
	}
	if m.Value != nil {
		if r.Value, err = m.Value.Encode(); err != nil {
			return nil, fmt.Errorf("franz: encode record value: %w", err)
		}
	}
	r.Headers = make([]kgo.RecordHeader, len(m.Headers))
	for i, h := range m.Headers {
		r.Headers[i] = kgo.RecordHeader{Key: string(h.Key), Value: h.Value}
	}
	return r, nil
}

// IsTransactional reports whether the producer has a TransactionalID.
func (p *syncProducer) IsTransactional() bool { return p.transactional }

// TxnStatus is the transaction state in Sarama's flags: ready, in a
// transaction, abortable (a record or the commit failed: abort it), or
// aborting (an abort that failed: abort again).
func (p *syncProducer) TxnStatus() sarama.ProducerTxnStatusFlag {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.status
}

// BeginTxn starts a transaction.
func (p *syncProducer) BeginTxn() error {
	if err := p.cl.BeginTransaction(); err != nil {
		return err
	}
	p.set(sarama.ProducerTxnFlagInTransaction)
	return nil
}

// CommitTxn flushes and commits the transaction. A failed commit leaves
// it abortable: franz-go refuses to retry a commit whose outcome is
// unknown, and an abort fences whatever the broker still holds of it.
func (p *syncProducer) CommitTxn() error {
	ctx := context.Background()
	err := p.cl.Flush(ctx)
	if err == nil {
		err = p.cl.EndTransaction(ctx, kgo.TryCommit)
	}
	if err != nil {
		p.set(sarama.ProducerTxnFlagInTransaction | sarama.ProducerTxnFlagAbortableError)
		return err
	}
	p.set(sarama.ProducerTxnFlagReady)
	return nil
}

// AbortTxn drops the records not sent yet and aborts the transaction.
func (p *syncProducer) AbortTxn() error {
	ctx := context.Background()
	err := p.cl.AbortBufferedRecords(ctx)
	if err == nil {
		err = p.cl.EndTransaction(ctx, kgo.TryAbort)
	}
	if err != nil {
		p.set(sarama.ProducerTxnFlagAbortingTransaction)
		return err
	}
	p.set(sarama.ProducerTxnFlagReady)
	return nil
}

func (p *syncProducer) set(st sarama.ProducerTxnStatusFlag) {
	p.mu.Lock()
	p.status = st
	p.mu.Unlock()
}

// AddOffsetsToTxn is not supported: it returns an error.
func (p *syncProducer) AddOffsetsToTxn(map[string][]*sarama.PartitionOffsetMetadata, string) error {
	return errOffsetsInTxn
}

// AddOffsetsToTxnWithGroupMetadata is not supported: it returns an error.
func (p *syncProducer) AddOffsetsToTxnWithGroupMetadata(map[string][]*sarama.PartitionOffsetMetadata, *sarama.ConsumerGroupMetadata) error {
	return errOffsetsInTxn
}

// AddMessageToTxn is not supported: it returns an error.
func (p *syncProducer) AddMessageToTxn(*sarama.ConsumerMessage, string, *string) error {
	return errOffsetsInTxn
}

// AddMessageToTxnWithGroupMetadata is not supported: it returns an error.
func (p *syncProducer) AddMessageToTxnWithGroupMetadata(*sarama.ConsumerMessage, *sarama.ConsumerGroupMetadata, *string) error {
	return errOffsetsInTxn
}

// Close flushes (outside a transaction) and closes the client.
func (p *syncProducer) Close() error {
	p.once.Do(p.cl.Close)
	return nil
}
