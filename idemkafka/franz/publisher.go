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
	// ClientOpts are more franz-go options (TLS, SASL, ClientID,
	// linger...). The Publisher sets the seed brokers after them; franz-go's
	// producer is idempotent with acks=all unless they say otherwise.
	// Defaults to none.
	ClientOpts []kgo.Opt
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
	once   sync.Once
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher validates cfg and returns a Publisher with its client. A
// nil logger logs nothing.
func NewPublisher(cfg PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("franz: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), cfg.ClientOpts...), kgo.SeedBrokers(cfg.Brokers...))...)
	if err != nil {
		return nil, fmt.Errorf("franz: new Kafka client: %w", err)
	}
	return &Publisher{cl: cl, logger: logger}, nil
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
	if err := p.cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		return fmt.Errorf("franz: publish to %s: %w", topic, err)
	}
	return nil
}

// Close flushes and closes the client.
func (p *Publisher) Close() error {
	p.once.Do(p.cl.Close)
	return nil
}
