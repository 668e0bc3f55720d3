package franz

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Subscriber is a Watermill message.Subscriber on a Kafka consumer group,
// on franz-go, with idemkafka/parallel's guarantees: up to MaxInFlight
// messages in flight in the order its Ordering asks for (by default a
// message waits only for the earlier messages of its key in its
// partition), and per partition only the offset below which every message
// is acked is committed. Create it with [NewSubscriber].
type Subscriber struct {
	cfg    SubscriberConfig
	logger watermill.LoggerAdapter

	slots   chan struct{} // MaxInFlight tokens
	closing chan struct{}
	closed  chan struct{} // Close is done: every slot is free
	once    sync.Once
	wg      sync.WaitGroup

	mu      sync.Mutex
	streams map[*stream]struct{}
	static  map[string]bool // with InstanceID: the topics with a live Subscribe call
}

var _ message.Subscriber = (*Subscriber)(nil)

// errClosed is returned by Subscribe on a closed Subscriber.
var errClosed = errors.New("franz: subscriber closed")

// NewSubscriber validates cfg and returns a Subscriber; it connects to
// Kafka on Subscribe. A nil logger logs nothing.
func NewSubscriber(cfg SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("franz: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Subscriber{
		cfg:     cfg,
		logger:  logger.With(watermill.LogFields{"subscriber": "franz", "consumer_group": cfg.ConsumerGroup}),
		slots:   make(chan struct{}, cfg.MaxInFlight),
		closing: make(chan struct{}),
		closed:  make(chan struct{}),
		streams: map[*stream]struct{}{},
		static:  map[string]bool{},
	}, nil
}

// MaxInFlight is the most messages the Subscriber hands out at once: with
// the dedup middleware in one-transaction-per-message mode, the pool needs
// that many connections (idem.Config.Concurrency).
func (s *Subscriber) MaxInFlight() int { return s.cfg.MaxInFlight }

// Subscribe joins the consumer group on topic and returns the channel of
// its messages. With GroupProtocol "consumer" it first asks the broker whether
// it speaks KIP-848, and returns an [*UnsupportedError] when not. The
// channel closes when ctx ends or the Subscriber closes, after the
// messages in flight were given RevokeTimeout and the offsets were
// committed. Each call is its own group member (a share group's, its own
// ShareMembers members); with InstanceID, one live call per topic.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errClosed
	default:
	}
	if s.cfg.ShareGroup != "" {
		return s.subscribeShare(ctx, topic)
	}
	if s.cfg.GroupProtocol == protocolConsumer {
		// KIP-848 as Kafka 4.0 stabilized it: ConsumerGroupHeartbeat v1.
		if err := s.checkAPI(ctx, kmsg.NewPtrConsumerGroupHeartbeatRequest().Key(), 1,
			"KIP-848 consumer group protocol", "ConsumerGroupHeartbeat v1"); err != nil {
			return nil, err
		}
	}
	if s.cfg.InstanceID != "" {
		if err := s.claimInstance(topic); err != nil {
			return nil, err
		}
	}
	sctx, cancel := context.WithCancel(ctx)
	st := &stream{
		s: s, topic: topic, ctx: sctx, cancel: cancel,
		out:    make(chan *message.Message),
		wake:   make(chan struct{}, 1),
		parts:  map[int32]*part{},
		logger: s.logger.With(watermill.LogFields{"topic": topic}),
	}
	cl, err := kgo.NewClient(s.clientOpts(st)...)
	if err != nil {
		s.releaseInstance(topic)
		cancel()
		return nil, fmt.Errorf("franz: new Kafka client: %w", err)
	}
	st.cl = cl
	s.mu.Lock()
	select {
	case <-s.closing:
		delete(s.static, topic)
		s.mu.Unlock()
		cancel()
		cl.Close()
		return nil, errClosed
	default:
	}
	s.streams[st] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	go st.run()
	return st.out, nil
}

// clientOpts are the user's options, then the Subscriber's.
func (s *Subscriber) clientOpts(st *stream) []kgo.Opt {
	opts := append([]kgo.Opt{kgo.FetchMaxWait(s.cfg.FetchMaxWait)}, s.cfg.ClientOpts...)
	opts = append(opts,
		kgo.SeedBrokers(s.cfg.Brokers...),
		kgo.ConsumerGroup(s.cfg.ConsumerGroup),
		kgo.ConsumeTopics(st.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		// Aborted transactions (the outbox forwarder's failed pages) are
		// never handed out.
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.Balancers(kgo.CooperativeStickyBalancer()),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(st.assigned),
		kgo.OnPartitionsRevoked(st.revoked),
		kgo.OnPartitionsLost(st.lost),
	)
	if s.cfg.GroupProtocol == protocolConsumer {
		opts = append(opts, kgo.ServerSideBalancer())
	}
	if s.cfg.InstanceID != "" {
		opts = append(opts, kgo.InstanceID(instanceID(s.cfg.InstanceID, st.topic)))
	}
	if s.cfg.Progress != nil {
		opts = append(opts, kgo.AdjustFetchOffsetsFn(st.adjustOffsets))
	}
	return opts
}

// maxKafkaInstanceID is the longest group.instance.id Kafka takes.
const maxKafkaInstanceID = 249

// instanceID is the group.instance.id of the member on topic: the same
// after a restart, and one per topic, since a Subscriber holds at most one
// live Subscribe call per topic with an InstanceID (claimInstance).
func instanceID(prefix, topic string) string {
	return prefix + "-" + topic
}

// claimInstance reserves topic's static member for a Subscribe call: a
// second live call on the topic would join with the same
// group.instance.id and fence the first (classic) or be refused
// (KIP-848).
func (s *Subscriber) claimInstance(topic string) error {
	if id := instanceID(s.cfg.InstanceID, topic); len(id) > maxKafkaInstanceID {
		return fmt.Errorf("franz: InstanceID: %q is over Kafka's %d characters for a group.instance.id", id, maxKafkaInstanceID)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.static[topic] {
		return fmt.Errorf("franz: InstanceID: topic %q already has a live Subscribe call on this Subscriber, as static member %q: "+
			"a static member is one per topic (use another Subscriber, with its own InstanceID)", topic, instanceID(s.cfg.InstanceID, topic))
	}
	s.static[topic] = true
	return nil
}

// releaseInstance frees topic's static member once its Subscribe call has
// ended (or failed).
func (s *Subscriber) releaseInstance(topic string) {
	if s.cfg.InstanceID == "" {
		return
	}
	s.mu.Lock()
	delete(s.static, topic)
	s.mu.Unlock()
}

// checkAPI asks a broker for its API versions and returns an
// [*UnsupportedError] naming feature when it lacks request key at
// minVersion: franz-go would otherwise fall back (KIP-848 to the classic
// protocol) or fail later without a word.
func (s *Subscriber) checkAPI(ctx context.Context, key, minVersion int16, feature, api string) error {
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), s.cfg.ClientOpts...), kgo.SeedBrokers(s.cfg.Brokers...))...)
	if err != nil {
		return fmt.Errorf("franz: new Kafka client: %w", err)
	}
	defer cl.Close()
	resp, err := kmsg.NewPtrApiVersionsRequest().RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("franz: asking the broker for its API versions: %w", err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return fmt.Errorf("franz: asking the broker for its API versions: %w", err)
	}
	for _, k := range resp.ApiKeys {
		if k.ApiKey == key && k.MaxVersion >= minVersion {
			return nil
		}
	}
	return &UnsupportedError{Feature: feature, API: api}
}

// Close leaves the groups: each partition's messages in flight get
// RevokeTimeout to be acked, the offsets are committed, and the channels
// Subscribe returned are closed. It returns when all of that is done.
func (s *Subscriber) Close() error {
	s.once.Do(func() {
		s.mu.Lock()
		close(s.closing)
		for st := range s.streams {
			st.cancel()
		}
		s.mu.Unlock()
		s.wg.Wait()
		close(s.closed)
	})
	return nil
}
