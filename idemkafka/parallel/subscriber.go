package parallel

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
	"github.com/idemkit/watermill-idempotency/internal/saramastrategy"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// Subscriber is a Watermill message.Subscriber on a Kafka consumer group
// that keeps up to MaxInFlight messages in flight, in the order its
// [Ordering] asks for (by default a message waits only for the earlier
// messages of its key in its partition), and commits per partition only the
// offset below which every message is acked. Use it in
// router.AddConsumerHandler in place of watermill-kafka's subscriber,
// behind the same dedup middleware. Create it with [NewSubscriber].
type Subscriber struct {
	cfg    SubscriberConfig
	sarama *sarama.Config
	logger watermill.LoggerAdapter

	slots   chan struct{} // MaxInFlight tokens
	closing chan struct{} // closed by Close
	closed  chan struct{} // closed when Close is done: releases every slot
	once    sync.Once
	wg      sync.WaitGroup

	mu      sync.Mutex
	streams map[*stream]struct{}
	stats   counters

	onRevoke func(partition int32) // test hook (export_test.go): a partition's final mark, called with mu held
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber validates cfg and returns a Subscriber; it connects to
// Kafka on Subscribe. A nil logger falls back to cfg.Client.Logger, then
// logs nothing.
func NewSubscriber(cfg SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("parallel: invalid config: %w", err)
	}
	if logger == nil {
		logger = cfg.Client.Logger
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Subscriber{
		cfg:     cfg,
		sarama:  cfg.saramaConfig(),
		logger:  logger.With(watermill.LogFields{"subscriber": "parallel", "consumer_group": cfg.ConsumerGroup}),
		slots:   make(chan struct{}, cfg.MaxInFlight),
		closing: make(chan struct{}),
		closed:  make(chan struct{}),
		streams: map[*stream]struct{}{},
	}, nil
}

// MaxInFlight is the most messages the Subscriber hands out at once, and
// so the most handlers running at once on its messages. With the dedup
// middleware in one-transaction-per-message mode each of them holds a
// database connection for its transaction: give the pool at least this
// many (idem.Config.Concurrency checks it at start-up). With group commit
// the groups use GroupCommitConfig.Concurrency connections instead.
func (s *Subscriber) MaxInFlight() int { return s.cfg.MaxInFlight }

// errClosed is returned by Subscribe on a closed Subscriber.
var errClosed = errors.New("parallel: subscriber closed")

// Subscribe joins the consumer group on topic and returns the channel of
// its messages. The channel closes when ctx ends or the Subscriber
// closes, after the messages in flight were given RevokeTimeout to be
// acked and the offsets were committed. Each call has its own Kafka client
// and group member; MaxInFlight is shared by all of them.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errClosed
	default:
	}
	sc := *s.sarama
	saramastrategy.Own(&sc) // a member's sticky strategies are its own
	tracked := trackConns(&sc)
	client, err := sarama.NewClient(s.cfg.Client.Brokers, &sc)
	if err != nil {
		return nil, fmt.Errorf("parallel: new Kafka client: %w", err)
	}
	group, err := sarama.NewConsumerGroupFromClient(s.cfg.ConsumerGroup, client)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("parallel: new consumer group: %w", err)
	}
	sctx, cancel := context.WithCancel(ctx)
	st := &stream{
		s:       s,
		topic:   topic,
		ctx:     sctx,
		cancel:  cancel,
		client:  client,
		conns:   tracked,
		group:   group,
		out:     make(chan *message.Message),
		wake:    make(chan struct{}, 1),
		parts:   map[int32]*partState{},
		metaMax: s.cfg.CommitMetadataMaxBytes,
		logger:  s.logger.With(watermill.LogFields{"topic": topic}),
	}
	s.mu.Lock()
	select {
	case <-s.closing:
		s.mu.Unlock()
		cancel()
		_ = group.Close()
		_ = client.Close()
		return nil, errClosed
	default:
	}
	s.streams[st] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	go st.run()
	return st.out, nil
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

// stream is one Subscribe call: a group member on one topic, its
// partitions, and the queue of messages ready to be handed out.
type stream struct {
	s      *Subscriber
	topic  string
	ctx    context.Context // ends on Close or when Subscribe's ctx ends
	cancel context.CancelFunc
	client sarama.Client
	conns  *conns // the client's broker connections
	group  sarama.ConsumerGroup
	out    chan *message.Message
	logger watermill.LoggerAdapter

	fetchers sync.WaitGroup // the partitions' fetchLoops
	fetchMu  sync.Mutex
	// refetch reads spilled records again, on connections of its own: a
	// broker answers one connection's requests in order, so behind the
	// group's fetches, which wait up to Consumer.MaxWaitTime at the end of
	// the partitions, each of a pass's requests would wait as long.
	// Created on first use.
	refetch sarama.Client

	// guarded by s.mu
	metaMax int           // the commit metadata bound: CommitMetadataMaxBytes, halved on each OffsetMetadataTooLarge
	wake    chan struct{} // an entry became ready (buffered 1)
	parts   map[int32]*partState
	// timeline is PostgreSQL's timeline when the session read its
	// positions (Progress): a write on another one is fenced.
	timeline int64
}

// run consumes the group until the stream ends, then closes out.
func (st *stream) run() {
	defer st.s.wg.Done()
	var wg sync.WaitGroup
	wg.Go(func() {
		for err := range st.group.Errors() {
			if st.commitRefused(err) {
				continue
			}
			st.logger.Error("Consumer group error", err, nil)
		}
	})
	dispatched := make(chan struct{})
	go func() {
		defer close(dispatched)
		st.dispatch()
	}()
	h := &groupHandler{st: st}
	finished := make(chan struct{})
	defer close(finished)
	go st.boundClose(finished)
	for {
		err := st.group.Consume(st.ctx, []string{st.topic}, h)
		if st.ctx.Err() != nil {
			break
		}
		if err == nil {
			continue // the session ended in a rebalance: rejoin at once
		}
		st.logger.Error("Consume failed, joining again", err, watermill.LogFields{"retry_in": st.s.cfg.ReconnectRetrySleep.String()})
		if wait.Sleep(st.ctx, st.s.cfg.ReconnectRetrySleep) != nil {
			break
		}
	}
	if err := st.group.Close(); err != nil {
		st.logger.Error("Closing the consumer group", err, nil)
	}
	wg.Wait()
	<-dispatched
	st.fetchers.Wait()
	st.fetchMu.Lock()
	if st.refetch != nil {
		if err := st.refetch.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
			st.logger.Error("Closing the Kafka client of spilled records", err, nil)
		}
	}
	st.fetchMu.Unlock()
	if err := st.client.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
		st.logger.Error("Closing the Kafka client", err, nil)
	}
	st.s.mu.Lock()
	delete(st.s.streams, st)
	st.s.mu.Unlock()
	close(st.out)
}

// commitRefused counts and logs an offset commit the broker refused, and
// reports whether err was one. On OffsetMetadataTooLarge (the brokers'
// offset.metadata.max.bytes is below CommitMetadataMaxBytes) the stream
// halves the metadata it writes and marks its partitions again, so that
// the next commit can pass: Sarama retries a refused commit with whatever
// was marked last.
func (st *stream) commitRefused(err error) bool {
	var cerr *sarama.ConsumerError
	if !errors.As(err, &cerr) || (!errors.Is(cerr.Err, sarama.ErrOffsetMetadataTooLarge) && !errors.Is(cerr.Err, sarama.ErrInvalidCommitOffsetSize)) {
		return false
	}
	s := st.s
	s.mu.Lock()
	s.stats.commitsRefused++
	s.stats.lastCommitRefusal = err
	tooLarge := errors.Is(cerr.Err, sarama.ErrOffsetMetadataTooLarge)
	if tooLarge && st.metaMax > 0 {
		st.metaMax /= 2
		for _, p := range st.parts {
			p.changed = true
		}
	}
	metaMax := st.metaMax
	s.mu.Unlock()
	fields := watermill.LogFields{"kafka_partition": cerr.Partition}
	if tooLarge {
		fields["commit_metadata_max_bytes"] = metaMax
		st.logger.Error("Offset commit refused by the broker: the committed offset does not move until a commit passes; "+
			"the commit metadata is halved (set CommitMetadataMaxBytes within the brokers' offset.metadata.max.bytes, BrokerMetadataMaxBytes)", err, fields)
	} else {
		st.logger.Error("Offset commit refused by the broker: the committed offset does not move until a commit passes", err, fields)
	}
	return true
}

// boundClose cuts the stream's broker connections when the stream has not
// finished RevokeTimeout + closeGrace after it ended (Close, or Subscribe's
// context): Sarama's Consume does not watch its context while a JoinGroup
// is pending, and a coordinator holds a JoinGroup for up to the rebalance
// timeout (60 s by default) while another member does not rejoin; the
// consumer group's Close waits behind it, and Sarama closes a broker only
// once its pending response is in. Cutting the connections fails the
// request, so a stop takes RevokeTimeout + closeGrace at most; the member
// then leaves by its session timeout instead of a LeaveGroup.
func (st *stream) boundClose(finished <-chan struct{}) {
	select {
	case <-finished:
		return
	case <-st.ctx.Done():
	}
	t := time.NewTimer(st.s.cfg.Client.RevokeTimeout + closeGrace)
	defer t.Stop()
	select {
	case <-finished:
	case <-t.C:
		st.logger.Info("The consumer group did not stop in time (a JoinGroup the coordinator holds, or an offset commit): cutting its broker connections",
			watermill.LogFields{"waited": (st.s.cfg.Client.RevokeTimeout + closeGrace).String()})
		st.conns.cutAll()
	}
}

// closeGrace is what a stop gives the final offset commit and the
// LeaveGroup after RevokeTimeout.
const closeGrace = 5 * time.Second

// dispatch hands out the ready entries, one MaxInFlight slot each, until
// the stream ends.
func (st *stream) dispatch() {
	s := st.s
	for {
		if !st.awaitReady() {
			return
		}
		select {
		case s.slots <- struct{}{}:
		case <-st.ctx.Done():
			return
		}
		// Picked once the slot is ours, so that the slot goes to the
		// partition holding the fewest then.
		s.mu.Lock()
		e := st.pickReady()
		s.mu.Unlock()
		if e == nil {
			<-s.slots // taken back meanwhile (a revocation)
			continue
		}
		msg, err := st.handOut(e)
		if err != nil {
			<-s.slots
			continue
		}
		if msg == nil {
			<-s.slots // its partition stopped meanwhile
			continue
		}
		select {
		case st.out <- msg:
			go st.await(e, msg, e.cancel)
		case <-e.p.ctx.Done():
			// Revoked past its timeout before the router took it.
			s.mu.Lock()
			e.p.drop(e)
			s.mu.Unlock()
			e.cancel()
			<-s.slots
		case <-st.ctx.Done():
			s.mu.Lock()
			e.p.drop(e)
			s.mu.Unlock()
			e.cancel()
			<-s.slots
			return
		}
	}
}

// awaitReady waits for a ready entry of a live partition; false when the
// stream ends.
func (st *stream) awaitReady() bool {
	s := st.s
	for {
		s.mu.Lock()
		ok := st.hasReady()
		if !ok && s.stats.inflight < s.cfg.MaxInFlight {
			st.kickAll() // a slot free, nothing ready: full windows may spill
		}
		s.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-st.wake:
		case <-st.ctx.Done():
			return false
		}
	}
}

// hasReady reports whether a live partition has a ready entry. Called with
// s.mu held.
func (st *stream) hasReady() bool {
	for _, p := range st.parts {
		if p.stopping {
			continue
		}
		for _, e := range p.ready {
			if e.State == keywindow.Ready {
				return true
			}
		}
	}
	return false
}

// handOut marks e in flight and builds its message; nil when its partition
// stopped since e became ready.
func (st *stream) handOut(e *entry) (*message.Message, error) {
	s := st.s
	msg, err := s.cfg.Unmarshaler.Unmarshal(e.m)
	s.mu.Lock()
	defer s.mu.Unlock()
	p := e.p
	if p.stopping || e.State != keywindow.Ready {
		return nil, nil
	}
	if err != nil {
		// A record that cannot become a message cannot be processed; the
		// partition stops here, as watermill-kafka's does.
		err = fmt.Errorf("parallel: unmarshal %s/%d@%d: %w", e.m.Topic, e.m.Partition, e.m.Offset, err)
		st.logger.Error("Message unmarshal failed: its key stops at it, and the committed offset of its partition", err, nil)
		e.State = keywindow.Failed
		e.nacks++
		e.lastErr = err
		return nil, err
	}
	e.State = keywindow.InFlight
	p.inflight++
	s.stats.inflight++
	if e.m.Offset > p.highest {
		p.highest = e.m.Offset
	}
	e.start = time.Now()
	e.slot = &errSlot{}
	// As Watermill's subscribers do, a message's context ends with its ack
	// or nack (await), and when its partition is abandoned.
	ctx, cancel := context.WithCancel(p.ctx)
	e.cancel = cancel
	msg.SetContext(messageContext(ctx, e.m, s.cfg.Ordering, e.slot))
	return msg, nil
}

// await waits for msg's ack or nack. Its slot is freed only then (or when
// the Subscriber has closed), even after its partition was revoked, so
// MaxInFlight bounds the handlers running at once.
func (st *stream) await(e *entry, msg *message.Message, cancel context.CancelFunc) {
	s := st.s
	defer cancel()
	select {
	case <-msg.Acked():
		s.mu.Lock()
		e.p.acked(e)
		s.mu.Unlock()
	case <-msg.Nacked():
		s.mu.Lock()
		e.p.nacked(e)
		s.mu.Unlock()
	case <-s.closed:
	}
	<-s.slots
}

// pickReady takes the first ready entry of the partition with the fewest
// messages in flight among those with ready entries, so that a partition
// whose handlers run long (or fail and run again) does not take every
// MaxInFlight slot while others have work: each freed slot goes to the
// partition that holds the fewest. Called with s.mu held.
func (st *stream) pickReady() *entry {
	var best *partState
	for _, p := range st.parts {
		for len(p.ready) > 0 && (p.ready[0].State != keywindow.Ready || p.stopping) {
			p.ready[0] = nil
			p.ready = p.ready[1:]
		}
		if len(p.ready) > 0 && (best == nil || p.inflight < best.inflight) {
			best = p
		}
	}
	if best == nil {
		return nil
	}
	e := best.ready[0]
	best.ready[0] = nil
	best.ready = best.ready[1:]
	if len(best.ready) == 0 {
		best.ready = nil
		best.kick() // its last ready record: it may spill now
	}
	return e
}

// unready drops p's entries from the ready queue, so that a revoked
// partition's records are not kept until the dispatcher next runs. Called
// with s.mu held.
func (st *stream) unready(p *partState) {
	clear(p.ready)
	p.ready = nil
}

// push queues e as ready. Called with s.mu held.
func (st *stream) push(e *entry) {
	e.State = keywindow.Ready
	e.p.ready = append(e.p.ready, e)
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// refill runs pass: it reads the partition again from pass.from
// (partState.refilled). Errors are logged and retried after
// ReconnectRetrySleep until the partition is revoked.
func (st *stream) refill(p *partState, pass *refillPass) {
	for {
		err := st.tryRefill(p, pass)
		if err == nil || p.ctx.Err() != nil {
			return
		}
		if errors.Is(err, sarama.ErrOffsetOutOfRange) {
			// Retention removed the head the pass starts at: it is done
			// (nothing to process); the next pass starts from the heads
			// still queued.
			st.s.mu.Lock()
			if !p.stopping {
				p.lost(pass.heads, pass.from)
			}
			st.s.mu.Unlock()
			return
		}
		st.logger.Error("Reading spilled records again failed, retrying", err, watermill.LogFields{
			"kafka_partition": p.partition, "kafka_partition_offset": pass.from, "retry_in": st.s.cfg.ReconnectRetrySleep.String()})
		if wait.Sleep(p.ctx, st.s.cfg.ReconnectRetrySleep) != nil {
			return
		}
	}
}

// tryRefill reads p from pass.from on a consumer of its own: a partition
// consumer's Close waits for its next fetch, so the pass closes it
// asynchronously, and one consumer would refuse the next pass's partition
// consumer ("already being consumed") until the previous one had gone.
func (st *stream) tryRefill(p *partState, pass *refillPass) error {
	st.fetchMu.Lock()
	if st.refetch == nil {
		client, err := sarama.NewClient(st.s.cfg.Client.Brokers, st.client.Config())
		if err != nil {
			st.fetchMu.Unlock()
			return err
		}
		st.refetch = client
	}
	client := st.refetch
	st.fetchMu.Unlock()
	c, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return err
	}
	pc, err := c.ConsumePartition(st.topic, p.partition, pass.from)
	if err != nil {
		_ = c.Close() // it does not close the shared client
		return err
	}
	defer func() {
		// Close waits for the consumer's next fetch: the refill does not.
		pc.AsyncClose()
		st.fetchers.Go(func() {
			for range pc.Errors() {
			}
		})
		st.fetchers.Go(func() {
			for range pc.Messages() {
			}
			_ = c.Close()
		})
	}()
	for {
		select {
		case m := <-pc.Messages():
			st.s.mu.Lock()
			over := p.refilled(pass, m)
			st.s.mu.Unlock()
			if over {
				return nil
			}
		case err := <-pc.Errors():
			return err
		case <-p.ctx.Done():
			return nil
		}
	}
}
