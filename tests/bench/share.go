package bench

import (
	"context"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka/franz"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("share-group", shareGroup) }

// shareSubscriber is the franz-go subscriber in share group group (no
// order), MaxInFlight inFlight.
func (r *parRig) shareSubscriber(group string, inFlight int) (message.Subscriber, int, error) {
	s, err := franz.NewSubscriber(franz.SubscriberConfig{Brokers: r.brokers, ShareGroup: group, Ordering: parallel.OrderNone, MaxInFlight: inFlight}, nil)
	if err != nil {
		return nil, 0, err
	}
	return s, s.MaxInFlight(), nil
}

// franzSubscriber is the franz-go engine's subscriber in the rig's
// consumer group (MaxInFlight inFlight, the partition window as the
// parallel subscriber's), keeping the position with progress.
func (r *parRig) franzSubscriber(group string, inFlight int, progress bool) (message.Subscriber, int, error) {
	cfg := franz.SubscriberConfig{Brokers: r.brokers, ConsumerGroup: group, MaxInFlight: inFlight, PartitionWindow: max(1024, inFlight/parPartitions)}
	if progress {
		cfg.Progress, cfg.ProgressSchema = r.db.Pool, r.table.Schema
	}
	s, err := franz.NewSubscriber(cfg, nil)
	if err != nil {
		return nil, 0, err
	}
	return s, s.MaxInFlight(), nil
}

// shareGroup compares a share group with the parallel subscriber on the
// lease section's 50 ms workload, both in lease mode on the small pool.
func shareGroup(ctx context.Context, o Options) (Section, error) {
	r, err := newParRig(ctx, o)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	r.keys = leaseKeys
	if err := r.warm(ctx); err != nil {
		return Section{}, err
	}
	small, err := r.pool(ctx, o, leasePoolConns)
	if err != nil {
		return Section{}, err
	}
	defer small.Close()
	n := leaseSizesFor(o)
	if !o.Short {
		// 12,000 events ran half a second at 8,192 in flight, mostly
		// ramp-up and drain: the share row's ratio spanned 0.71–1.32 over
		// 6 rounds. 48,000 make runs of about 2 s.
		n.slowN = 48000
	}
	par := parConsumer{name: fmt.Sprintf("lease mode (defaults), parallel subscriber (Sarama, MaxInFlight %d), pool of %d", leaseMaxInFlight, leasePoolConns),
		parallel: true, lease: &idem.LeaseConfig{}, maxInFlight: leaseMaxInFlight, pool: small, handler: leaseSlow(parSlowCall)}
	share := par
	share.name = fmt.Sprintf("lease mode (defaults), franz-go share group (MaxInFlight %d), pool of %d", leaseMaxInFlight, leasePoolConns)
	share.parallel, share.share = false, true
	w := leaseWorkload{fmt.Sprintf("handler waits %s", parSlowCall), n.slowN, []leaseVariant{{par, n.slowN, false}, {share, n.slowN, false}}}
	m, err := r.measureLease(ctx, o, []leaseWorkload{w}, n.rounds)
	if err != nil {
		return Section{}, err
	}
	rates := m.rates[0]
	st := Summarise(Ratios(rates[0], rates[1]))
	o.Logf("  share group, %s: parallel %s msg/s, share group %s msg/s, ratio %s", w.name, fmtRate(rates[0]), fmtRate(rates[1]), st)
	rows := [][]string{
		{w.name, par.name, fmtRate(rates[0]), "1", "–"},
		{w.name, share.name, fmtRate(rates[1]), st.String(), fmt.Sprintf("≥ 0.8×: %s", pass(st.Median >= 0.8))},
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workload", "consumer", "msg/s (median)", "× parallel", "target"}, rows))
	fmt.Fprintf(&b, "\nThe lease section's workload (%d keys, %d events per run, the call outside any transaction, the business row registered "+
		"with Complete) on the parallel subscriber and on a share group (no order); %d round(s) rotated, each run a new group.\n",
		leaseKeys, n.slowN, n.rounds)
	return Section{Title: "Share group (KIP-932) against the parallel subscriber, lease mode", Markdown: b.String()}, nil
}
