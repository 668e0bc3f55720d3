package soak

import (
	"math/rand/v2"
	"slices"
	"time"
)

// event is one planned business event.
type event struct {
	aggregate int
	seq       int // 1, 2, ... within the aggregate
	amount    int64
	dlq       bool // copied to the dead-letter topic after group 1 applied it, then replayed
	double    bool // published twice, concurrently
}

// makePlan derives the events from the seed.
func makePlan(cfg Config) []event {
	r := rand.New(rand.NewPCG(cfg.Seed, 0x5eed_e7e7))
	seqs := make([]int, cfg.Aggregates)
	plan := make([]event, cfg.Events)
	for i := range plan {
		a := r.IntN(cfg.Aggregates)
		seqs[a]++
		plan[i] = event{
			aggregate: a,
			seq:       seqs[a],
			amount:    1 + r.Int64N(1000),
			dlq:       r.IntN(100) < cfg.DLQPercent,
			double:    r.IntN(100) < cfg.DoublePercent,
		}
	}
	return plan
}

// Fault kinds, as printed in the report.
const (
	faultKillMid        = "kill-mid-handler"
	faultKillCommit     = "kill-after-commit"
	faultJoin           = "join (rebalance)"
	faultLeave          = "leave (rebalance)"
	faultRestart        = "restart (rejoin)"
	faultTermConsumer   = "pg-terminate-consumer"
	faultTermProducer   = "pg-terminate-producer"
	faultRestartFwd     = "restart-forwarder"
	faultOffsetReset    = "offset-reset"
	progressDenominator = 3 // produced + applied by group 1 + applied by group 2
)

// scheduled is one fault, fired once progress reaches at (in units of
// produced + applied events, out of 3 x Events).
type scheduled struct {
	at    int64
	kind  string
	group int
	pick  uint64        // chooses the target among the live ones
	delay time.Duration // before a killed instance is replaced
	until int64         // join: progress at which the extra instance leaves
}

func makeSchedule(cfg Config) []scheduled {
	r := rand.New(rand.NewPCG(cfg.Seed, 0xfa17_5eed))
	total := int64(progressDenominator * cfg.Events)
	at := func(lo, hi float64) int64 {
		return int64(lo*float64(total)) + r.Int64N(max(1, int64((hi-lo)*float64(total))))
	}
	var s []scheduled
	add := func(n int, kind string, lo, hi float64) {
		for range n {
			f := scheduled{at: at(lo, hi), kind: kind, group: r.IntN(2), pick: r.Uint64(),
				delay: time.Duration(100+r.IntN(900)) * time.Millisecond}
			if kind == faultJoin {
				f.until = min(total*9/10, f.at+total/10+r.Int64N(total/10+1))
			}
			s = append(s, f)
		}
	}
	fc := cfg.Faults
	add(fc.KillMidHandler, faultKillMid, 0.03, 0.9)
	add(fc.KillAfterCommit, faultKillCommit, 0.03, 0.9)
	add(fc.Join, faultJoin, 0.03, 0.7)
	add(fc.TerminateConsumer, faultTermConsumer, 0.03, 0.9)
	add(fc.TerminateProducer, faultTermProducer, 0.01, 0.3)
	add(fc.RestartForwarder, faultRestartFwd, 0.01, 0.3)
	for g := range 2 {
		for range fc.OffsetResetPerGrp {
			s = append(s, scheduled{at: at(0.3, 0.7), kind: faultOffsetReset, group: g, pick: r.Uint64()})
		}
	}
	slices.SortStableFunc(s, func(a, b scheduled) int { return int(a.at - b.at) })
	return s
}
