package bench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/relaystep"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// e2eResult is one pipeline round.
type e2eResult struct {
	consumed  float64 // first handled to last committed (router + dedup + row + outbox)
	forwarded float64 // first handled to last forwarded record read back; 0 if incomplete
	// complete is false when not every record was forwarded within the
	// wait after consumption ended (see xminHolder).
	complete     bool
	forwardedNum int64
	latencies    []time.Duration
	// toKafka is the outbox's own share: from the handler's publish (the
	// event handed to the outbox inside the dedup transaction) to the
	// broker's acknowledgement of the forwarded record (ackTimer).
	toKafka []time.Duration
	// toCommit is the part of toKafka before the dedup transaction's
	// COMMIT returned to the handler's middleware.
	toCommit []time.Duration
	stats    idem.Stats // the middleware's counters at the end
	// cpuPerEvent is this process's CPU time (processCPU: the pipeline,
	// the forwarder, the reader and an in-process broker; not
	// PostgreSQL's) from the first handled event to the last forwarded
	// record read back, per event; 0 if incomplete.
	cpuPerEvent time.Duration
	// serverCPUPerEvent is the pool's PostgreSQL backends' CPU time
	// (backendsCPU) over the whole round (the consumer group's join
	// included), per event; 0 if incomplete or not readable.
	serverCPUPerEvent time.Duration
}

// pipelineSpec describes one pipeline round.
type pipelineSpec struct {
	in          string
	n           int
	produceRate float64
	poll        time.Duration
	fwdWait     time.Duration
	// notify enables the outbox table's notify trigger (the writers send
	// NOTIFY) and the forwarder's Listen.
	notify bool
	// groupCommit, when set, is the middleware's Config.Mode = &GroupCommitConfig{}.
	groupCommit *idem.GroupCommitConfig
	// skipProgress is the middleware's Config.SkipProgress.
	skipProgress bool
	// subscriberProgress: the subscriber keeps the position itself
	// (idemkafka.ClientConfig.Progress, or the parallel and franz-go
	// subscribers' SubscriberConfig.Progress); the middleware then writes
	// none per transaction.
	subscriberProgress bool
	// inMiddleware, when set, is called with each successful message's
	// time inside the dedup middleware (arrival to result).
	inMiddleware func(time.Duration)
	// parallel > 0 consumes with the parallel subscriber at that
	// MaxInFlight instead of watermill-kafka's.
	parallel int
	// franz, with parallel > 0, consumes with the franz-go engine's
	// subscriber (idemkafka/franz) and forwards with its producer.
	franz bool
	// observe, when set, gets the forwarder's steps (relaystep); committed
	// and acked, when set, get each measured row of a paced round, by its
	// publish time (publishedAtKey): when the dedup transaction's COMMIT
	// returned, and when the broker acknowledged the forwarded record.
	observe          relaystep.Observer
	committed, acked func(publishedAt int64, at time.Time)
	// serial runs the forwarder as before its reads were pipelined
	// (relaystep.WithSerial).
	serial bool
	// completeExec: the handler registers its business row with
	// idem.CompleteExec (run at once in transaction mode, gathered into
	// the group's pipeline with group commit) instead of Exec on the
	// transaction.
	completeExec bool
}

// pipelineWith is one pipeline round as described by s.
func (r *e2eRig) pipelineWith(ctx context.Context, s pipelineSpec) (e2eResult, error) {
	p := &pipelineRound{r: r, s: s, consumed: newSpan(s.n), forwarded: newSpan(s.n), warmedUp: make(chan struct{})}
	res := &p.res
	out, err := r.outTopic(ctx, s.notify)
	if err != nil {
		return *res, err
	}
	group := fmt.Sprintf("bench-e2e-%d", r.seq.Add(1))
	var sub message.Subscriber
	var progress migrate.DBTX
	if s.subscriberProgress {
		progress = r.db.Pool
	}
	switch {
	case s.parallel > 0 && s.franz:
		fs, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: r.brokers, ConsumerGroup: group, MaxInFlight: s.parallel, Progress: progress, ProgressSchema: r.table.Schema}, nil)
		if err != nil {
			return *res, err
		}
		sub = fs
		defer fs.Close()
	case s.parallel > 0:
		ps, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: r.brokers}, ConsumerGroup: group, MaxInFlight: s.parallel, Progress: progress, ProgressSchema: r.table.Schema}, nil)
		if err != nil {
			return *res, err
		}
		sub = ps
		defer ps.Close() // runRouterOn closes it too: twice is harmless
	case s.subscriberProgress:
		cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: r.brokers, Progress: r.db.Pool, ProgressSchema: r.table.Schema}, group)
		if err != nil {
			return *res, err
		}
		ws, err := kafka.NewSubscriber(cfg, watermill.NopLogger{})
		if err != nil {
			return *res, err
		}
		sub = ws
		defer ws.Close()
	}
	dedup, err := idem.NewDedup(idem.Config{DB: r.db.Pool, ConsumerGroup: group, Table: r.table, Outbox: r.outbox, Mode: s.groupCommit, Concurrency: s.parallel, SkipProgress: s.skipProgress}, nil)
	if err != nil {
		return *res, err
	}
	var producer sarama.SyncProducer
	if s.franz {
		producer, err = franz.NewSyncProducer(franz.PublisherConfig{Brokers: r.brokers})
	} else {
		producer, err = idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: r.brokers})
	}
	if err != nil {
		return *res, err
	}
	defer producer.Close()
	stopFwd, err := p.startForwarder(ctx, producer, out)
	if err != nil {
		return *res, err
	}
	defer stopFwd()
	res.latencies = make([]time.Duration, 0, s.n)
	stopRead, readErr := r.readAll(out, s.n, func(sentAt, publishedAt int64, now time.Time) {
		res.latencies = append(res.latencies, now.Sub(time.Unix(0, sentAt)))
		if p.forwarded.count.Load() == int64(s.n)-1 { // the last one (got is called one at a time)
			p.cpuLast.Store(int64(processCPU()))
		}
		p.forwarded.mark()
	})
	defer stopRead()
	h := p.handler(dedup.Middleware(p.publishForward))
	// A paced round measures a running pipeline: warm-up events first (the
	// consumer group joined, partitions fetched, pools and the forwarder's
	// connections opened), then the measured ones.
	if s.produceRate > 0 {
		if err := p.producePaced(ctx); err != nil {
			return *res, err
		}
	}
	serverBefore, serverOK := backendsCPU(ctx, r.db.Pool)
	if err := r.runRouterOn(ctx, sub, s.in, group, out, h, p.stopWhenForwarded(ctx)); err != nil {
		return *res, fmt.Errorf("%w (handled %d, forwarded %d of %d)", err, p.consumed.count.Load(), p.forwarded.count.Load(), s.n)
	}
	stopRead()
	if err := readErr(); err != nil {
		return *res, err
	}
	// Stop the forwarder before reading toKafka (deferred too: twice is
	// harmless).
	stopFwd()
	if p.consumed.count.Load() < int64(s.n) {
		return *res, fmt.Errorf("bench: end-to-end round stopped after %d of %d events", p.consumed.count.Load(), s.n)
	}
	res.consumed = p.consumed.rate()
	res.stats = dedup.Stats()
	res.forwardedNum = p.forwarded.count.Load()
	if res.complete = res.forwardedNum == int64(s.n); res.complete {
		res.forwarded = p.forwarded.rate()
		res.cpuPerEvent = time.Duration(p.cpuLast.Load()-p.cpuFirst.Load()) / time.Duration(s.n)
		if after, ok := backendsCPU(ctx, r.db.Pool); ok && serverOK {
			res.serverCPUPerEvent = (after - serverBefore) / time.Duration(s.n)
		}
	}
	return *res, nil
}

// outTopic makes the topic a pipeline round forwards to, with its outbox
// tables, their notify trigger enabled when notify is set.
func (r *e2eRig) outTopic(ctx context.Context, notify bool) (string, error) {
	out, err := r.topic("bench-out")
	if err != nil {
		return "", err
	}
	if err := migrateTopic(ctx, r.db.Pool, r.outbox, out); err != nil {
		return "", err
	}
	if notify {
		if _, err := r.db.Pool.Exec(ctx, "ALTER TABLE "+r.outbox.MessagesTable(out)+" ENABLE TRIGGER idem_outbox_notify"); err != nil {
			return "", err
		}
	}
	return out, nil
}

// pipelineRound is the state of one pipelineWith round.
type pipelineRound struct {
	r   *e2eRig
	s   pipelineSpec
	res e2eResult
	// consumed spans the events handled (after COMMIT), forwarded the
	// records read back from the out topic.
	consumed, forwarded *span
	publishedAt         sync.Map // input message UUID → the handler's publish time
	warmedUp            chan struct{}
	warm                atomic.Int64 // warm-up events handled
	// cpuFirst and cpuLast are processCPU at the first measured event
	// handled and at the last record read back.
	cpuFirst, cpuLast atomic.Int64
	toKafkaMu         sync.Mutex
	toCommitMu        sync.Mutex
}

// startForwarder runs the round's forwarder of out on producer, which
// times each record's acknowledgement (res.toKafka), and returns how to
// stop it (and wait for it: twice is harmless).
func (p *pipelineRound) startForwarder(ctx context.Context, producer sarama.SyncProducer, out string) (stop func(), err error) {
	s := p.s
	acked := ackTimer{SyncProducer: producer, acked: func(publishedAt int64, at time.Time) {
		p.toKafkaMu.Lock()
		p.res.toKafka = append(p.res.toKafka, at.Sub(time.Unix(0, publishedAt)))
		p.toKafkaMu.Unlock()
		if s.acked != nil {
			s.acked(publishedAt, at)
		}
	}}
	fwd, err := outbox.NewForwarder(outbox.ForwarderConfig{DB: p.r.db.Pool, Outbox: p.r.outbox, Producer: acked, Topics: []string{out}, PollInterval: s.poll, Listen: s.notify}, nil)
	if err != nil {
		return nil, err
	}
	fctx, stopFwd := context.WithCancel(ctx)
	fwdErr := make(chan error, 1)
	runCtx := fctx
	if s.observe != nil {
		runCtx = relaystep.With(runCtx, s.observe)
	}
	if s.serial {
		runCtx = relaystep.WithSerial(runCtx)
	}
	go func() { fwdErr <- fwd.Run(runCtx) }()
	var once sync.Once
	return func() { once.Do(func() { stopFwd(); <-fwdErr }) }, nil
}

// publishForward is the business handler: one business row, and one event
// published to the outbox, stamped with the input's send time and its own
// publish time.
func (p *pipelineRound) publishForward(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	if p.s.completeExec {
		if err := idem.CompleteExec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
			return nil, err
		}
	} else if _, err := idem.MustTxFromContext(ctx).Exec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
		return nil, err
	}
	fwdMsg := message.NewMessage(watermill.NewUUID(), msg.Payload)
	fwdMsg.Metadata.Set(sentAtKey, msg.Metadata.Get(sentAtKey))
	if msg.Metadata.Get(warmupKey) != "" {
		fwdMsg.Metadata.Set(warmupKey, "1")
	}
	publisher.WithPartitionKey(fwdMsg, msg.Metadata.Get(publisher.MetadataPartitionKey))
	now := time.Now()
	fwdMsg.Metadata.Set(publishedAtKey, strconv.FormatInt(now.UnixNano(), 10))
	if p.s.produceRate > 0 {
		p.publishedAt.Store(msg.UUID, now)
	}
	return []*message.Message{fwdMsg}, nil
}

// handler is the router's handler around mw, the dedup middleware: it
// counts the warm-up events apart and times the measured ones.
func (p *pipelineRound) handler(mw message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(warmupKey) != "" {
			out, err := mw(msg)
			if err == nil && p.warm.Add(1) == warmupEvents {
				close(p.warmedUp)
			}
			return out, err
		}
		if p.consumed.first.Load() == 0 && p.consumed.first.CompareAndSwap(0, time.Now().UnixNano()) {
			p.cpuFirst.Store(int64(processCPU()))
			p.forwarded.first.CompareAndSwap(0, p.consumed.first.Load())
		}
		start := time.Now()
		out, err := mw(msg)
		if err == nil {
			if p.s.inMiddleware != nil {
				p.s.inMiddleware(time.Since(start))
			}
			p.consumed.mark() // after COMMIT
			p.committed(msg)
		}
		return out, err
	}
}

// committed records, for a paced round, the time from msg's publish in the
// handler to its COMMIT.
func (p *pipelineRound) committed(msg *message.Message) {
	at, ok := p.publishedAt.LoadAndDelete(msg.UUID)
	if !ok {
		return
	}
	now := time.Now()
	p.toCommitMu.Lock()
	p.res.toCommit = append(p.res.toCommit, now.Sub(at.(time.Time)))
	p.toCommitMu.Unlock()
	if p.s.committed != nil {
		p.s.committed(at.(time.Time).UnixNano(), now)
	}
}

// producePaced produces the warm-up events, then, once they were handled,
// the measured ones at the round's rate.
func (p *pipelineRound) producePaced(ctx context.Context) error {
	if err := p.r.produceMarked(p.s.in, warmupEvents, 0, true); err != nil {
		return err
	}
	go func() {
		select {
		case <-p.warmedUp:
			_ = p.r.produce(p.s.in, p.s.n, p.s.produceRate)
		case <-ctx.Done():
		}
	}()
	return nil
}

// stopWhenForwarded is closed when everything was forwarded and handled,
// or fwdWait after the consuming side finished. A record can be forwarded
// before its handler returned (its COMMIT is done, the reply on its way):
// stopping the router then would cancel that handler's context.
func (p *pipelineRound) stopWhenForwarded(ctx context.Context) <-chan struct{} {
	stop := make(chan struct{})
	go func() {
		defer close(stop)
		select {
		case <-p.forwarded.done:
		case <-p.consumed.done:
		case <-ctx.Done():
			return
		}
		t := time.NewTimer(p.s.fwdWait)
		defer t.Stop()
		for _, done := range []chan struct{}{p.forwarded.done, p.consumed.done} {
			select {
			case <-done:
			case <-t.C:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return stop
}
