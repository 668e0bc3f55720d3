package soak

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// event is one planned business event.
type event struct {
	aggregate int
	seq       int // 1, 2, ... within the aggregate
	amount    int64
	dlq       bool // copied to the dead-letter topic after group 1 applied it, then replayed
	double    bool // published twice, concurrently
	// fail is how many times the handler fails transiently on this event
	// (in each group) before it succeeds: 0, or 1 to [maxPlannedFailures]
	// for [Config.RetryPercent] of the events. It travels in the payload.
	fail int
	// sleep is how long the handler takes on the event: 0, or 200 to
	// 500 ms for the hot key's events ([Config.HostileKeys]). It travels
	// in the payload.
	sleep time.Duration
	// block marks the failing key's first event ([Config.HostileKeys]):
	// the handler fails on it, and it is nacked, until the soak releases
	// it. It travels in the payload.
	block bool
}

// maxPlannedFailures is the most transient failures planned for one event.
const maxPlannedFailures = 3

// makePlan derives the events from the seed. The planned failures and the
// hostile keys come from streams of their own, so the rest of a seed's
// plan is the same with or without them (but for the events the hostile
// keys take over: their aggregates' later sequence numbers shift).
func makePlan(cfg Config) []event {
	r := rand.New(rand.NewPCG(cfg.Seed, 0x5eed_e7e7))
	rf := rand.New(rand.NewPCG(cfg.Seed, 0xfa11_5eed))
	rh := rand.New(rand.NewPCG(cfg.Seed, 0x4057_11e5))
	rp := rand.New(rand.NewPCG(cfg.Seed, 0x9015_0e5d)) // the share leg's poison events
	seqs := make([]int, cfg.Aggregates+hostileAggregates)
	plan := make([]event, cfg.Events)
	for i := range plan {
		a := r.IntN(cfg.Aggregates)
		ev := event{
			amount: 1 + r.Int64N(1000),
			dlq:    r.IntN(100) < cfg.DLQPercent,
			double: r.IntN(100) < cfg.DoublePercent,
		}
		if rf.IntN(100) < cfg.RetryPercent {
			ev.fail = 1 + rf.IntN(maxPlannedFailures)
			if cfg.Share {
				ev.fail = 1 + (ev.fail-1)%shareMaxPlannedFailures
			}
		}
		if cfg.Share && rp.IntN(100) < SharePoisonPercent {
			ev.fail = poisonFail
		}
		if cfg.HostileKeys {
			a = hostileKey(cfg, a, rh, &ev)
		}
		seqs[a]++
		ev.aggregate, ev.seq = a, seqs[a]
		ev.block = a == failingAggregate(cfg) && ev.seq == 1
		plan[i] = ev
	}
	return plan
}

// Fault kinds, as printed in the report.
const (
	faultKillMid       = "sigkill-mid-handler"
	faultKillCommit    = "sigkill-after-commit"
	faultKillAfterCall = "sigkill-after-call" // lease mode's mid-handler kill: the call returned, not completed
	faultKillMidCall   = "sigkill-mid-call"   // lease mode: the provider executing the call
	faultSigkill       = "sigkill-random"
	faultCrashLoop     = "sigkill-while-joining (crash loop)"
	faultDisrupt       = "pg-disruption"
	faultJoin          = "join (rebalance)"
	faultLeave         = "leave (rebalance)"
	faultRestart       = "restart (rejoin)"
	faultTermConsumer  = "pg-terminate-consumer"
	faultTermProducer  = "pg-terminate-producer"
	faultRestartFwd    = "restart-forwarder"
	faultOffsetReset   = "offset-reset"
	faultLeader        = "leader-election"
	faultOversize      = "oversize-row"
	faultFailover      = "failover (async standby promoted)"
	faultRolling       = "rolling-restart"
)

// poisonFail is the planned failure count of a share-group leg's poison
// event ([SharePoisonPercent]): it fails on every delivery.
const poisonFail = 1000

// shareMaxPlannedFailures is the most transient failures planned for an
// event of the share-group leg: [ShareMaxDeliveries] - 3, so that two
// deliveries lost to faults (a SIGKILL, a leave or a leader election
// releases the records a member had acquired: each acquisition counts) do
// not poison it. With 2, a full run with leader elections saw an event
// lose two deliveries so and be poisoned at its 4th (its 2nd failure).
const shareMaxPlannedFailures = ShareMaxDeliveries - 3

// leaderBrokers is how many brokers the in-process cluster runs when the
// fault mix has leader elections (node ids 0 to leaderBrokers-1).
const leaderBrokers = 3

// What a fault's progress mark counts.
const (
	byApplied  = iota // events applied by both groups (out of 2 x Events)
	byProduced        // events produced (out of Events)
	byGroup           // events applied by the fault's group (out of Events)
)

// scheduled is one fault, fired once the progress it counts reaches at.
type scheduled struct {
	at    int64
	by    int
	kind  string
	group int
	pick  uint64 // chooses the target among the live ones
	until int64  // join: progress at which the extra instance leaves
}

func makeSchedule(cfg Config) []scheduled {
	r := rand.New(rand.NewPCG(cfg.Seed, 0xfa17_5eed))
	span := func(by int) int64 {
		if by == byApplied {
			return int64(2 * cfg.Events)
		}
		return int64(cfg.Events)
	}
	at := func(by int, lo, hi float64) int64 {
		total := float64(span(by))
		return int64(lo*total) + r.Int64N(max(1, int64((hi-lo)*total)))
	}
	var s []scheduled
	add := func(n int, kind string, by int, lo, hi float64) {
		for range n {
			f := scheduled{at: at(by, lo, hi), by: by, kind: kind, group: r.IntN(2), pick: r.Uint64()}
			if kind == faultJoin {
				total := span(by)
				f.until = min(total*9/10, f.at+total/10+r.Int64N(total/10+1))
			}
			s = append(s, f)
		}
	}
	fc := cfg.Faults
	// The faults a consumer executes on its next applied message, or that
	// need its connections, count their own group's progress: a tenth of
	// its events is still to come when they fire.
	killMid := faultKillMid
	if cfg.Lease {
		killMid = faultKillAfterCall // no transaction in the handler: between the call and the completion
	}
	add(fc.KillMidHandler, killMid, byGroup, 0.03, 0.9)
	add(fc.KillAfterCommit, faultKillCommit, byGroup, 0.03, 0.9)
	add(fc.Kill, faultSigkill, byApplied, 0.03, 0.9)
	add(fc.CrashLoop, faultCrashLoop, byApplied, 0.05, 0.7)
	add(fc.DisruptDB, faultDisrupt, byApplied, 0.1, 0.8)
	add(fc.Join, faultJoin, byApplied, 0.03, 0.7)
	add(fc.TerminateConsumer, faultTermConsumer, byGroup, 0.03, 0.9)
	add(fc.TerminateProducer, faultTermProducer, byProduced, 0.05, 0.9)
	add(fc.RestartForwarder, faultRestartFwd, byProduced, 0.05, 0.9)
	add(fc.LeaderElection, faultLeader, byProduced, 0.05, 0.9)
	add(fc.OversizeRow, faultOversize, byProduced, 0.05, 0.9)
	add(fc.RollingRestart, faultRolling, byApplied, 0.1, 0.7)
	// Lease mode only (the other modes make no call): a stream of its
	// own, so the rest of a seed's schedule stays as it was.
	rl := rand.New(rand.NewPCG(cfg.Seed, 0x1ea5_e5ed))
	for range fc.KillMidCall {
		s = append(s, scheduled{at: int64(0.03*float64(cfg.Events)) + rl.Int64N(max(1, int64(0.87*float64(cfg.Events)))), by: byGroup, kind: faultKillMidCall, group: rl.IntN(2), pick: rl.Uint64()})
	}
	// The failover: a stream of its own, so the rest of a seed's schedule
	// stays as it was; mid-run by the events applied (the producers run
	// ahead), so that events flow before and after it.
	rv := rand.New(rand.NewPCG(cfg.Seed, 0xfa11_07e5))
	for range fc.Failover {
		s = append(s, scheduled{at: int64(0.6*float64(cfg.Events)) + rv.Int64N(max(1, int64(0.4*float64(cfg.Events)))), by: byApplied, kind: faultFailover})
	}
	for g := range 2 {
		for range fc.OffsetResetPerGrp {
			s = append(s, scheduled{at: at(byGroup, 0.3, 0.7), by: byGroup, kind: faultOffsetReset, group: g, pick: r.Uint64()})
		}
	}
	return s
}

// faultFlags names the fault kinds for [ParseFaults].
var faultFlags = []struct {
	name string
	n    func(*FaultCounts) *int
}{
	{"mid-handler", func(f *FaultCounts) *int { return &f.KillMidHandler }},
	{"mid-call", func(f *FaultCounts) *int { return &f.KillMidCall }},
	{"after-commit", func(f *FaultCounts) *int { return &f.KillAfterCommit }},
	{"kill", func(f *FaultCounts) *int { return &f.Kill }},
	{"crash-loop", func(f *FaultCounts) *int { return &f.CrashLoop }},
	{"disrupt", func(f *FaultCounts) *int { return &f.DisruptDB }},
	{"join", func(f *FaultCounts) *int { return &f.Join }},
	{"pg-consumer", func(f *FaultCounts) *int { return &f.TerminateConsumer }},
	{"pg-producer", func(f *FaultCounts) *int { return &f.TerminateProducer }},
	{"restart-forwarder", func(f *FaultCounts) *int { return &f.RestartForwarder }},
	{"offset-reset", func(f *FaultCounts) *int { return &f.OffsetResetPerGrp }},
	{"leader-election", func(f *FaultCounts) *int { return &f.LeaderElection }},
	{"oversize-row", func(f *FaultCounts) *int { return &f.OversizeRow }},
	{"failover", func(f *FaultCounts) *int { return &f.Failover }},
	{"rolling-restart", func(f *FaultCounts) *int { return &f.RollingRestart }},
}

// ParseFaults reads a fault mix such as "kill=3,crash-loop=1" on top of
// base; kinds: mid-handler, mid-call (lease mode), after-commit, kill, crash-loop, disrupt, join,
// pg-consumer, pg-producer, restart-forwarder, offset-reset (per group),
// leader-election, oversize-row, rolling-restart, failover.
func ParseFaults(base FaultCounts, spec string) (FaultCounts, error) {
	for _, kv := range strings.Split(spec, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		name, val, ok := strings.Cut(kv, "=")
		n, err := strconv.Atoi(val)
		if !ok || err != nil || n < 0 {
			return base, fmt.Errorf("fault %q: want kind=count", kv)
		}
		found := false
		for _, f := range faultFlags {
			if f.name == name {
				*f.n(&base) = n
				found = true
			}
		}
		if !found {
			return base, fmt.Errorf("fault %q: unknown kind", name)
		}
	}
	return base, nil
}
