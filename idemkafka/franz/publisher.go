package franz

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"
)

// PublisherConfig configures a [Publisher].
type PublisherConfig struct {
	// Brokers are the seed brokers. Required.
	Brokers []string
	// TransactionalID, when set, makes the producer transactional: each
	// Publish call is one Kafka transaction (all its messages become
	// visible to read_committed consumers, or none), one at a time, and
	// [NewSyncProducer]'s producer sends each outbox page as one. franz-go
	// speaks transaction version 2 (KIP-890) where the cluster enables it.
	// Defaults to "" (idempotent, not transactional).
	TransactionalID string
	// ClientOpts are more franz-go options (TLS, SASL, ClientID,
	// linger, the transaction timeout...). The seed brokers and the
	// transactional id are set after them; franz-go's producer is
	// idempotent with acks=all unless they say otherwise. Defaults to
	// none.
	ClientOpts []kgo.Opt
}

// client validates c and returns its client.
func (c PublisherConfig) client() (*kgo.Client, error) {
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("franz: invalid config: %w", err)
	}
	opts := append(append([]kgo.Opt(nil), c.ClientOpts...), kgo.SeedBrokers(c.Brokers...))
	if c.TransactionalID != "" {
		opts = append(opts, kgo.TransactionalID(c.TransactionalID))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("franz: new Kafka client: %w", err)
	}
	return cl, nil
}

// Validate reports the first bad field.
func (c PublisherConfig) Validate() error {
	if len(c.Brokers) == 0 {
		return errors.New("Brokers: required")
	}
	return nil
}

// Publisher is a Watermill message.Publisher on franz-go. Records are
// watermill-kafka's (the UUID and metadata as headers) with the
// partition_key metadata as the key, as idemkafka.Marshaler writes them.
// Create it with [NewPublisher].
type Publisher struct {
	cl     *kgo.Client
	logger watermill.LoggerAdapter
	txn    bool
	txnMu  sync.Mutex // one transaction at a time
	once   sync.Once
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher validates cfg and returns a Publisher with its client. A
// nil logger logs nothing.
func NewPublisher(cfg PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	cl, err := cfg.client()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Publisher{cl: cl, logger: logger, txn: cfg.TransactionalID != ""}, nil
}

// Publish writes msgs to topic and returns when the broker has them all:
// the records of one key keep their order.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	recs := make([]*kgo.Record, 0, len(msgs))
	for _, msg := range msgs {
		r, err := toRecord(topic, msg)
		if err != nil {
			return err
		}
		recs = append(recs, r)
	}
	if p.txn {
		return p.publishTxn(topic, recs)
	}
	if err := p.cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		return fmt.Errorf("franz: publish to %s: %w", topic, err)
	}
	return nil
}

// publishTxn writes recs as one transaction, aborted when any fails.
func (p *Publisher) publishTxn(topic string, recs []*kgo.Record) error {
	p.txnMu.Lock()
	defer p.txnMu.Unlock()
	ctx := context.Background()
	if err := p.cl.BeginTransaction(); err != nil {
		return fmt.Errorf("franz: begin Kafka transaction: %w", err)
	}
	err := p.cl.ProduceSync(ctx, recs...).FirstErr()
	if err == nil {
		if err = p.cl.EndTransaction(ctx, kgo.TryCommit); err == nil {
			return nil
		}
	}
	if aerr := p.cl.AbortBufferedRecords(ctx); aerr != nil {
		err = errors.Join(err, aerr)
	} else if aerr := p.cl.EndTransaction(ctx, kgo.TryAbort); aerr != nil {
		err = errors.Join(err, fmt.Errorf("abort: %w", aerr))
	}
	return fmt.Errorf("franz: publish to %s in a transaction: %w", topic, err)
}

// Close flushes and closes the client.
func (p *Publisher) Close() error {
	p.once.Do(p.cl.Close)
	return nil
}
