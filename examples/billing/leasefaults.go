package main

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// The faults of billing's lease mode: a provider slowdown (phase 2), a
// billing process killed between the phases of an event, and a lease taken
// over while its first owner is still calling (phase 3).

// slowLatency is the provider latency of the i-th order of the slowdown:
// from SlowLatency to SlowLatency + 1 s, spread by index (deterministic).
func (c demoConfig) slowLatency(i int) time.Duration {
	return c.SlowLatency + time.Duration(i*389%1000)*time.Millisecond
}

// phaseSlowdown confirms cfg.SlowOrders orders whose charges take 1–2 s,
// while a sampler reads pg_stat_activity every 20 ms: in lease mode no
// billing session sits idle in a transaction while the provider is slow.
func (d *demo) phaseSlowdown(ctx context.Context) error {
	k := d.cfg.SlowOrders
	if k == 0 {
		return nil
	}
	d.progress("phase 2: provider slowdown: %d more orders, each charge takes %s to %s; sampling pg_stat_activity every %s",
		k, d.cfg.slowLatency(0), d.cfg.SlowLatency+999*time.Millisecond, idleSampleEvery)
	slow := make([]Order, k)
	for i := range slow {
		slow[i] = Order{ID: fmt.Sprintf("ord-s%04d", i+1), CustomerID: fmt.Sprintf("cus-s%02d", i%7+1), TotalAmount: fmt.Sprintf("%d.50", 20+i), Currency: "EUR"}
		d.provider.SlowCharge(slow[i].ID, d.cfg.slowLatency(i))
	}
	before, beforeN := d.billing.dedup.Stats(), d.notification.dedup.Stats().Processed
	sampler, err := d.startIdleSampler(ctx)
	if err != nil {
		return err
	}
	start := time.Now()
	svc := d.orderService()
	var eg errgroup.Group
	eg.SetLimit(4)
	for _, o := range slow {
		eg.Go(func() error {
			_, err := svc.Confirm(ctx, o)
			return err
		})
	}
	err = eg.Wait()
	if err == nil {
		err = d.waitFor(ctx, "phase 2", func() bool {
			return d.billing.dedup.Stats().Processed >= before.Processed+uint64(k) && d.notification.dedup.Stats().Processed >= beforeN+uint64(k)
		})
	}
	idle := sampler.stop()
	if err != nil {
		return err
	}
	d.orders = append(d.orders, slow...)
	d.rep.Published += k
	d.rep.SlowOrders = k
	d.rep.SlowSeconds = time.Since(start).Seconds()
	d.rep.Idle = idle
	after := d.billing.dedup.Stats()
	d.rep.SlowRenewals = after.LeasesRenewed - before.LeasesRenewed
	d.progress("phase 2: billing charged %d slow orders in %.1fs; leases renewed %d times meanwhile; idle in transaction: at most %s over %d samples (%s; the forwarder's %s)",
		k, d.rep.SlowSeconds, d.rep.SlowRenewals, idle.Max.Round(time.Millisecond), idle.Samples, idle.worstOrNone(), idle.Forwarder.Round(time.Millisecond))
	d.status("phase 2 done")
	return nil
}

// idleSampleEvery is how often the sampler reads pg_stat_activity.
const idleSampleEvery = 20 * time.Millisecond

// idleStats is what the idle-in-transaction sampler saw.
type idleStats struct {
	Samples int
	// Max is the longest time a session of the demo (application_name
	// starting with its schema: its pools' and its child processes'),
	// the forwarder's aside, had been idle in a transaction at a sample;
	// Worst names that session: its application_name, the age of its
	// transaction (a transaction held across a provider call is 1-2 s old;
	// a short one whose client waited for a CPU is about as old as its
	// idle time) and its last statement.
	Max   time.Duration
	Worst string
	// HeldAcrossCall is the longest idle time of a session whose
	// transaction was older than the slowdown's shortest call (1 s): a
	// transaction held across a provider call, which lease mode must
	// never show. A long idle in a younger transaction is a client that
	// waited for a CPU between two statements (a loaded machine), which
	// the report prints but does not fail on.
	HeldAcrossCall time.Duration
	// Forwarder is the same for the outbox forwarder's sessions, reported
	// on its own: the forwarder keeps its position's transaction open
	// while Kafka acknowledges a batch (the position commits only after
	// the send), so its idle time is the broker's latency, whatever billing
	// does.
	Forwarder time.Duration
}

func (s idleStats) worstOrNone() string {
	if s.Worst == "" {
		return "no session was idle in a transaction at any sample"
	}
	return "longest: " + s.Worst
}

type idleSampler struct {
	quit chan struct{}
	done chan struct{}
	res  idleStats
}

// startIdleSampler samples, every idleSampleEvery, how long each of the
// demo's sessions (application_name starts with the schema) has been idle
// in a transaction, on a connection of its own.
func (d *demo) startIdleSampler(ctx context.Context) (*idleSampler, error) {
	ccfg, err := pgx.ParseConfig(d.cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	ccfg.RuntimeParams["application_name"] = "monitor/" + d.table.Schema
	conn, err := pgx.ConnectConfig(ctx, ccfg)
	if err != nil {
		return nil, fmt.Errorf("idle sampler: %w", err)
	}
	forwarder := d.table.Schema + "/" + serviceForwarder
	s := &idleSampler{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer conn.Close(context.WithoutCancel(ctx))
		t := time.NewTicker(idleSampleEvery)
		defer t.Stop()
		for {
			rows, err := conn.Query(ctx, `
				SELECT application_name, extract(epoch FROM clock_timestamp() - state_change)::float8,
				       extract(epoch FROM clock_timestamp() - xact_start)::float8, left(regexp_replace(query, '\s+', ' ', 'g'), 100)
				FROM pg_stat_activity
				WHERE state = 'idle in transaction' AND datname = current_database() AND starts_with(application_name, $1)`,
				d.table.Schema)
			if err == nil {
				var (
					app, query string
					secs, age  float64
				)
				_, err = pgx.ForEachRow(rows, []any{&app, &secs, &age, &query}, func() error {
					dur := time.Duration(secs * float64(time.Second))
					switch {
					case app == forwarder:
						s.res.Forwarder = max(s.res.Forwarder, dur)
					default:
						if age >= d.cfg.SlowLatency.Seconds() {
							s.res.HeldAcrossCall = max(s.res.HeldAcrossCall, dur)
						}
						if dur > s.res.Max {
							s.res.Max = dur
							s.res.Worst = fmt.Sprintf("%s, in a transaction %s old, after: %s", app, time.Duration(age*float64(time.Second)).Round(time.Millisecond), query)
						}
					}
					return nil
				})
				if err == nil {
					s.res.Samples++
				}
			}
			select {
			case <-s.quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return s, nil
}

func (s *idleSampler) stop() idleStats {
	close(s.quit)
	<-s.done
	return s.res
}

// phaseCrash runs two child billing processes in the billing group, each
// with one partition of orders.confirmed and one order on it, in lease
// mode:
//
//   - crash: the child takes the lease, calls the provider (which charges),
//     and is SIGKILLed before its completion. Its lease stays behind until
//     it expires; Kafka hands the partition to the demo's instances once the
//     dead member's session times out; the redelivery takes the expired
//     lease over and calls with the same Idempotency-Key: the provider
//     replays the charge.
//   - takeover: the child takes the lease and calls; the provider holds the
//     call, and the child is frozen (SIGSTOP: a process pause), so its
//     renewals cannot get through. The lease expires, the redelivery takes
//     it over while the first owner's call is still in progress at the
//     provider (409 to the same key), then the call is released, the new
//     owner gets the charge replayed and completes. Resumed (SIGCONT), the
//     first owner finds its lease lost and writes nothing.
func (d *demo) phaseCrash(ctx context.Context) error {
	if !d.cfg.CrashAndTakeover {
		return nil
	}
	if int(d.cfg.Partitions) < d.cfg.BillingInstances+2 {
		return fmt.Errorf("the crash phase needs a partition for each of the %d billing instances and the 2 child processes: -partitions %d is too few",
			d.cfg.BillingInstances, d.cfg.Partitions)
	}
	d.progress("phase 3: 2 more billing processes join group %s in lease mode (lease %s, renewed every %s): one will be SIGKILLed after its call, one frozen (SIGSTOP) in its call",
		d.n.billing, d.cfg.LeaseDuration, d.cfg.leaseRenew())
	crashName, stallName := "billing-crash"+d.suffix, "billing-stall"+d.suffix
	crashOrder, stallOrder := Order{CustomerID: "cus-k", TotalAmount: "77.00", Currency: "EUR"}, Order{CustomerID: "cus-k", TotalAmount: "88.00", Currency: "EUR"}
	parts, err := d.startCrashChildren(ctx, crashName, &crashOrder, stallName, &stallOrder)
	if err != nil {
		return err
	}
	crashed, stalled := parts.children[crashName], parts.children[stallName]

	hold := d.provider.HoldCharge(stallOrder.ID)
	defer hold.Release()
	before := d.billing.dedup.Stats()
	beforeNotified := d.notification.dedup.Stats().Processed
	busyBefore := d.provider.Stats().InFlight
	svc := d.orderService()
	for _, o := range []Order{crashOrder, stallOrder} {
		if _, err := svc.Confirm(ctx, o); err != nil {
			return err
		}
	}
	d.orders = append(d.orders, crashOrder, stallOrder)
	d.rep.Published += 2

	killed, err := d.awaitCrash(ctx, crashed, crashName, crashOrder)
	if err != nil {
		return err
	}

	frozen, err := d.freezeStalled(ctx, stalled, hold, stallName, stallOrder)
	if err != nil {
		return err
	}

	// The demo's instances get both partitions once the dead and the
	// frozen member are expelled, take both expired leases over, and the
	// takeover of the stalled order meets the first call still in
	// progress at the provider.
	if err := d.waitFor(ctx, "phase 3 (takeover)", func() bool {
		return d.provider.Stats().InFlight > busyBefore && d.billing.dedup.Stats().LeasesTakenOver >= before.LeasesTakenOver+1
	}); err != nil {
		return err
	}
	d.progress("phase 3: the redelivery of %s took the expired lease over %.1fs after the freeze; its call met the first owner's still in progress (409); releasing the held call",
		stallOrder.ID, time.Since(frozen).Seconds())
	hold.Release()
	if err := d.waitFor(ctx, "phase 3", func() bool {
		return d.billing.dedup.Stats().Processed >= before.Processed+2 && d.notification.dedup.Stats().Processed >= beforeNotified+2
	}); err != nil {
		return err
	}
	d.progress("phase 3: %s and %s completed by the demo's billing instances, %.1fs after the kill", crashOrder.ID, stallOrder.ID, time.Since(killed).Seconds())

	if err := d.resumeStalled(ctx, stalled, stallName, stallOrder); err != nil {
		return err
	}

	after := d.billing.dedup.Stats()
	d.rep.TakenOverInPhase = after.LeasesTakenOver - before.LeasesTakenOver
	d.check(d.rep.TakenOverInPhase >= 2, "phase 3: the demo's billing took %d expired leases over, want at least 2 (the crashed and the frozen owner's)", d.rep.TakenOverInPhase)
	d.status("phase 3 done")
	return nil
}

// freezeStalled waits for the stall child to take its lease and its call to
// hang at the provider, then freezes the process (SIGSTOP) and returns when.
func (d *demo) freezeStalled(ctx context.Context, stalled *child, hold *heldCharge, stallName string, stallOrder Order) (time.Time, error) {
	line, err := stalled.next(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("stall child: %w: %s", err, stalled.logs())
	}
	d.check(strings.HasPrefix(line, lineTaken), "stall child: wanted %q, got %q", lineTaken+"<event>", line)
	select {
	case <-hold.Arrived():
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	}
	if err := stalled.signal(syscall.SIGSTOP); err != nil {
		return time.Time{}, fmt.Errorf("SIGSTOP: %w", err)
	}
	frozen := time.Now()
	d.progress("phase 3: %s froze (SIGSTOP) in its call for %s: its lease expires in %s, its session in %s", stallName, stallOrder.ID, d.cfg.LeaseDuration, d.childSession())
	return frozen, nil
}

// awaitCrash waits for the crash child to report its call returned and to
// SIGKILL itself, and returns when it saw the kill.
func (d *demo) awaitCrash(ctx context.Context, crashed *child, crashName string, crashOrder Order) (time.Time, error) {
	line, err := crashed.next(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("crash child: %w: %s", err, crashed.logs())
	}
	d.check(strings.HasPrefix(line, lineCalled), "crash child: wanted %q, got %q", lineCalled+"<event>", line)
	d.check(crashed.killedBySIGKILL(), "crash child: not ended by SIGKILL (%v)", crashed.err)
	killed := time.Now()
	d.rep.Crash = fmt.Sprintf("%s SIGKILLed after the provider call of %s, before its completion", crashName, crashOrder.ID)
	d.progress("phase 3: %s", d.rep.Crash)
	return killed, nil
}

// resumeStalled resumes the frozen first owner: its renewal or its
// completion finds the lease gone.
func (d *demo) resumeStalled(ctx context.Context, stalled *child, stallName string, stallOrder Order) error {
	if err := stalled.signal(syscall.SIGCONT); err != nil {
		return fmt.Errorf("SIGCONT: %w", err)
	}
	line, err := stalled.next(ctx)
	if err != nil {
		return fmt.Errorf("stall child: %w: %s", err, stalled.logs())
	}
	outcome := strings.TrimPrefix(line, lineEnded)
	// ErrLeaseLost: from the completion, or from the handler, whose call a
	// renewal cancelled with it as the cause.
	d.check(strings.HasPrefix(outcome, "lost "), "stall child: its delivery should end with the lease lost, got %q", line)
	d.check(stalled.killedBySIGKILL(), "stall child: not ended by SIGKILL (%v)", stalled.err)
	d.rep.Takeover = fmt.Sprintf("%s's lease of %s taken over while it was frozen in its call; resumed, it ended with: %s", stallName, stallOrder.ID, outcome)
	d.progress("phase 3: %s", d.rep.Takeover)
	return nil
}

// startCrashChildren starts phase 3's two child processes in lease mode and
// tells each its order: an order id the producers put on the partition the
// child owns, set in crashOrder and stallOrder.
func (d *demo) startCrashChildren(ctx context.Context, crashName string, crashOrder *Order, stallName string, stallOrder *Order) (*childSet, error) {
	base := childConfig{
		DatabaseURL: d.cfg.DatabaseURL, Schema: d.table.Schema, Brokers: d.brokers, Topic: d.n.orders, ChargedTopic: d.n.charged,
		Group: d.n.billing, ProviderURL: d.provider.URL(), Lease: d.cfg.LeaseDuration, RenewInterval: d.cfg.leaseRenew(),
		SessionTimeout: d.childSession(), Verbose: d.cfg.childVerbose,
	}
	// The children join first; their partitions decide their orders: for
	// each, an order id the producers put on its partition, sent to it on
	// its standard input.
	parts, err := d.childPartitions(ctx, base, crashName, stallName)
	if err != nil {
		return nil, err
	}
	crashOrder.ID = orderOnPartition("ord-k", d.n.orders, parts.ids[crashName], d.cfg.Partitions)
	stallOrder.ID = orderOnPartition("ord-t", d.n.orders, parts.ids[stallName], d.cfg.Partitions)
	if err := parts.children[crashName].tell(crashOrder.ID); err != nil {
		return nil, err
	}
	if err := parts.children[stallName].tell(stallOrder.ID); err != nil {
		return nil, err
	}
	d.progress("phase 3: %s owns partition %d: order %s; %s owns partition %d: order %s",
		crashName, parts.ids[crashName], crashOrder.ID, stallName, parts.ids[stallName], stallOrder.ID)
	return parts, nil
}

// childSet is the children of phase 3 and the partition each owns.
type childSet struct {
	children map[string]*child
	ids      map[string]int32
}

// childPartitions starts one child per name and waits until the group's
// assignment gives each a partition of orders.confirmed (one each with the
// demo's 4 partitions and 2 instances).
func (d *demo) childPartitions(ctx context.Context, base childConfig, names ...string) (*childSet, error) {
	set := &childSet{children: map[string]*child{}, ids: map[string]int32{}}
	modes := map[int]string{0: childCrash, 1: childStall}
	for i, name := range names {
		cfg := base
		cfg.Mode, cfg.ClientID = modes[i], name
		c, err := d.startChild(ctx, cfg)
		if err != nil {
			return nil, err
		}
		set.children[name] = c
	}
	admin, err := sarama.NewClusterAdmin(d.brokers, idemkafka.SaramaConsumerConfig(nil))
	if err != nil {
		return nil, fmt.Errorf("kafka admin: %w", err)
	}
	defer admin.Close()
	want := d.cfg.BillingInstances + len(names)
	err = d.waitFor(ctx, "phase 3 (children joining)", func() bool {
		gd, err := admin.DescribeConsumerGroups([]string{d.n.billing})
		if err != nil || len(gd) != 1 || gd[0].State != "Stable" || len(gd[0].Members) != want {
			return false
		}
		got := map[string]int32{}
		for _, m := range gd[0].Members {
			a, err := m.GetMemberAssignment()
			if err != nil || a == nil {
				return false
			}
			if _, ours := set.children[m.ClientId]; ours {
				ps := a.Topics[d.n.orders]
				if len(ps) == 0 {
					return false
				}
				got[m.ClientId] = ps[0] // its target goes there; it nacks the rest
			}
		}
		if len(got) != len(names) {
			return false
		}
		set.ids = got
		return true
	})
	return set, err
}

// orderOnPartition returns the first order id prefix + n (n = 1, 2, ...)
// that the producers' hash partitioner (Sarama's default, keyed by the
// order id: the partition key) puts on partition p of topic.
func orderOnPartition(prefix, topic string, p, partitions int32) string {
	hp := sarama.NewHashPartitioner(topic)
	for n := 1; ; n++ {
		id := fmt.Sprintf("%s%04d", prefix, n)
		got, err := hp.Partition(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(id)}, partitions)
		if err == nil && got == p {
			return id
		}
	}
}

// childSession is the session timeout of phase 3's children: how long the
// group waits before it expels a dead or frozen one.
func (d *demo) childSession() time.Duration {
	if len(d.cfg.Brokers) > 0 {
		return 6 * time.Second // a real cluster's group.min.session.timeout.ms
	}
	return 2 * time.Second
}
