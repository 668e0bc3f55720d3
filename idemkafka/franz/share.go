package franz

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/internal/permanent"
)

// shareSlot is what a share-group message's context carries: its delivery
// count, the MaxDeliveries bound, and the handler's last error
// ([RecordErrors]) that decides between release and reject.
type shareSlot struct {
	delivery int32
	max      int
	err      atomic.Pointer[error]
}

// isPermanent is IsPermanentFunc, or idem.Permanent's mark alone.
func (s *Subscriber) isPermanent(err error) bool {
	if err == nil {
		return false
	}
	if f := s.cfg.IsPermanentFunc; f != nil && f(err) {
		return true
	}
	return permanent.Marked(err)
}

type shareSlotKey struct{}

// DeliveryCount is, for a message of a share-group Subscriber, how many
// times the broker has delivered its record (1 the first time).
func DeliveryCount(ctx context.Context) (int32, bool) {
	s, ok := ctx.Value(shareSlotKey{}).(*shareSlot)
	if !ok {
		return 0, false
	}
	return s.delivery, true
}

// RecordErrors is the router middleware of a share-group Subscriber: it
// records the handler's error for the Subscriber (a nack with an error
// wrapped by idem.Permanent, or one IsPermanentFunc reports, rejects the
// record instead of releasing it),
// and from delivery MaxDeliveries on makes a failure permanent
// (idem.Permanent), so that a poison queue filtered by idem.IsPermanent
// added before it takes the message. Add it after the poison queue and
// before the dedup middleware. Messages of a consumer-group Subscriber
// pass through.
func RecordErrors(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		slot, ok := msg.Context().Value(shareSlotKey{}).(*shareSlot)
		if err == nil || !ok {
			return msgs, err
		}
		if int(slot.delivery) >= slot.max && !permanent.Marked(err) {
			// idem.Permanent's mark (the leaf package: this one sits below
			// middleware).
			err = permanent.Mark(fmt.Errorf("delivery %d of at most %d failed: %w", slot.delivery, slot.max, err))
		}
		slot.err.Store(&err)
		return msgs, err
	}
}

// subscribeShare joins the share group on topic.
func (s *Subscriber) subscribeShare(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.checkAPI(ctx, kmsg.NewPtrShareGroupHeartbeatRequest().Key(), 1,
		"KIP-932 share groups", "ShareGroupHeartbeat v1"); err != nil {
		return nil, err
	}
	if err := s.setShareReset(ctx); err != nil {
		return nil, err
	}
	// ShareMembers members, each polling its share of MaxInFlight: while
	// one waits for the last acknowledgements of its poll, the others
	// hand out theirs.
	shares := shareOf(s.cfg.MaxInFlight, s.cfg.ShareMembers)
	clients := make([]*kgo.Client, 0, s.cfg.ShareMembers)
	for _, share := range shares {
		opts := append(append([]kgo.Opt(nil), s.cfg.ClientOpts...),
			kgo.SeedBrokers(s.cfg.Brokers...),
			kgo.ShareGroup(s.cfg.ShareGroup),
			// A poll takes up to the member's share of MaxInFlight, and
			// its next poll waits for all of them: fetch as many at once.
			kgo.ShareMaxRecords(int32(min(share, math.MaxInt32))),
			kgo.FetchIsolationLevel(kgo.ReadCommitted()),
			kgo.ConsumeTopics(topic),
		)
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			for _, c := range clients {
				c.Close()
			}
			return nil, fmt.Errorf("franz: new Kafka client: %w", err)
		}
		clients = append(clients, cl)
	}
	sctx, cancel := context.WithCancel(ctx)
	st := &stream{s: s, topic: topic, ctx: sctx, cancel: cancel,
		out:    make(chan *message.Message),
		logger: s.logger.With(watermill.LogFields{"topic": topic, "share_group": s.cfg.ShareGroup}),
	}
	s.mu.Lock()
	select {
	case <-s.closing:
		s.mu.Unlock()
		cancel()
		for _, c := range clients {
			c.Close()
		}
		return nil, errClosed
	default:
	}
	s.streams[st] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		var members sync.WaitGroup
		for i, cl := range clients {
			members.Go(func() { st.runShare(cl, shares[i]) })
		}
		members.Wait()
		st.s.mu.Lock()
		delete(st.s.streams, st)
		st.s.mu.Unlock()
		close(st.out)
	}()
	return st.out, nil
}

// shareOf splits maxInFlight between members: the first maxInFlight %
// members get one more.
func shareOf(maxInFlight, members int) []int {
	out := make([]int, members)
	for i := range out {
		out[i] = maxInFlight / members
		if i < maxInFlight%members {
			out[i]++
		}
	}
	return out
}

// setShareReset sets the group's share.auto.offset.reset.
func (s *Subscriber) setShareReset(ctx context.Context) error {
	if s.cfg.ShareOffsetReset == "none" {
		return nil
	}
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), s.cfg.ClientOpts...), kgo.SeedBrokers(s.cfg.Brokers...))...)
	if err != nil {
		return fmt.Errorf("franz: new Kafka client: %w", err)
	}
	defer cl.Close()
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	res := kmsg.NewIncrementalAlterConfigsRequestResource()
	res.ResourceType = kmsg.ConfigResourceTypeGroupConfig
	res.ResourceName = s.cfg.ShareGroup
	c := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
	c.Name = "share.auto.offset.reset"
	c.Op = kmsg.IncrementalAlterConfigOpSet
	c.Value = kmsg.StringPtr(s.cfg.ShareOffsetReset)
	res.Configs = append(res.Configs, c)
	req.Resources = append(req.Resources, res)
	resp, err := req.RequestWith(ctx, cl)
	if err == nil && len(resp.Resources) > 0 {
		err = kerr.ErrorForCode(resp.Resources[0].ErrorCode)
	}
	if err != nil {
		return fmt.Errorf("franz: set share.auto.offset.reset of share group %s: %w", s.cfg.ShareGroup, err)
	}
	return nil
}

// runShare is one member of the share group: it polls up to limit records,
// hands them out, and polls again once each was acked or nacked: franz-go
// accepts at the next poll whatever the previous one left without an
// acknowledgement.
func (st *stream) runShare(cl *kgo.Client, limit int) {
	for st.ctx.Err() == nil {
		fetches := cl.PollRecords(st.ctx, limit)
		if fetches.IsClientClosed() || st.ctx.Err() != nil {
			break
		}
		fetches.EachError(func(_ string, partition int32, err error) {
			if !errors.Is(err, context.Canceled) {
				st.logger.Error("Share fetch failed", err, watermill.LogFields{"kafka_partition": partition})
			}
		})
		st.handOutShare(fetches.Records())
	}
	// Records never handed out are released by the client's leave.
	flush, cancel := context.WithTimeout(context.Background(), st.s.cfg.RevokeTimeout)
	if err := cl.FlushAcks(flush); err != nil {
		st.logger.Error("Flushing the share acknowledgements", err, nil)
	}
	cancel()
	cl.Close()
}

// handOutShare hands out recs, one MaxInFlight slot each, and returns when
// every one handed out was acked or nacked (or, once the stream ends,
// after RevokeTimeout: the leave releases the others).
func (st *stream) handOutShare(recs []*kgo.Record) {
	var wg sync.WaitGroup
	ctx, abandon := context.WithCancel(context.WithoutCancel(st.ctx))
	defer abandon()
	for _, r := range recs {
		select {
		case st.s.slots <- struct{}{}:
		case <-st.ctx.Done():
			st.awaitShare(&wg, abandon)
			return
		}
		msg := toMessage(r)
		slot := &shareSlot{delivery: r.DeliveryCount(), max: st.s.cfg.MaxDeliveries}
		mctx, cancel := context.WithCancel(context.WithValue(ctx, shareSlotKey{}, slot))
		msg.SetContext(&recordContext{Context: mctx, r: r})
		select {
		case st.out <- msg:
		case <-st.ctx.Done():
			cancel()
			<-st.s.slots
			st.awaitShare(&wg, abandon)
			return
		}
		wg.Go(func() {
			defer cancel()
			defer func() { <-st.s.slots }()
			select {
			case <-msg.Acked():
				r.Ack(kgo.AckAccept)
			case <-msg.Nacked():
				st.nackShare(r, slot)
			case <-st.s.closed:
			}
		})
	}
	st.awaitShare(&wg, abandon)
}

// nackShare releases r for redelivery, or rejects it when its handler
// failed with a permanent error.
func (st *stream) nackShare(r *kgo.Record, slot *shareSlot) {
	var err error
	if p := slot.err.Load(); p != nil {
		err = *p
	}
	if st.s.isPermanent(err) {
		st.logger.Error("Share-group record rejected: its handler failed with a permanent error", err, watermill.LogFields{
			"kafka_partition": r.Partition, "kafka_partition_offset": r.Offset, "delivery": slot.delivery})
		r.Ack(kgo.AckReject)
		return
	}
	r.Ack(kgo.AckRelease)
}

// awaitShare waits for the messages handed out; once the stream has ended
// it gives them RevokeTimeout, then cancels their contexts and returns:
// the client's leave releases their records, and an ack arriving later
// is dropped.
func (st *stream) awaitShare(wg *sync.WaitGroup, abandon context.CancelFunc) {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return
	case <-st.ctx.Done():
	}
	select {
	case <-done:
	case <-time.After(st.s.cfg.RevokeTimeout):
		abandon()
	}
}
