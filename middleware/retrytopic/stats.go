package retrytopic

import "sync/atomic"

// Stats are a [RetryTopic]'s counters since it was created.
type Stats struct {
	// Retried: copies published to a retry topic after a transient failure.
	Retried uint64
	// Held: retry-topic copies that [RetryTopic.Middleware] itself made
	// wait for their not-before time (those [HoldingTracer] held arrive on
	// time and are not counted).
	Held uint64
	// Recovered: retry-topic copies that then succeeded (the handler ran,
	// or the claim showed the event already applied).
	Recovered uint64
	// Poisoned: messages published to the poison topic, for any reason.
	Poisoned uint64
	// Exhausted: of Poisoned, those whose attempts ran out.
	Exhausted uint64
	// Followed: events parked behind an earlier event of their key
	// ([KeyOrder]), to wait in the parked-keys table.
	Followed uint64
	// Released: parked events released from the parked-keys table
	// ([KeyOrder]), because they succeeded or were poisoned.
	Released uint64
	// HandedOff: of Released, those whose release handed their key to the
	// next parked event (written to the retry path through the outbox).
	HandedOff uint64
	// Stale: retry-topic copies acked without running because their event
	// is no longer parked while its key waits for another event (a second
	// copy of a released event).
	Stale uint64
	// OverdueKeys, unlike the counters above, is a reading: the parked
	// keys whose first event's copy was overdue by more than
	// [KeyOrder.OverdueAfter] at the last check (a stalled retry path).
	OverdueKeys uint64
}

type counters struct {
	retried, held, recovered, poisoned, exhausted, followed, released, handedOff, stale atomic.Uint64
	overdueKeys                                                                         atomic.Uint64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Retried: c.retried.Load(), Held: c.held.Load(), Recovered: c.recovered.Load(),
		Poisoned: c.poisoned.Load(), Exhausted: c.exhausted.Load(),
		Followed: c.followed.Load(), Released: c.released.Load(), HandedOff: c.handedOff.Load(), Stale: c.stale.Load(),
		OverdueKeys: c.overdueKeys.Load(),
	}
}
