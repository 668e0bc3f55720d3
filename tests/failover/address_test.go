package failover_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
)

// TestFailoverBehindOneAddress_Parallel: the consumers keep running while
// the database's address moves from the dead primary to the promoted
// standby (a virtual IP, a DNS name). The subscriber's next write of its
// position finds the server on a new timeline and ends the session; the
// next session starts from the promoted standby's position, so the lost
// events are processed again, once each. Key order is logged, not
// asserted: events handed out between the move and that write (at most
// half of Sarama's auto-commit interval) may be applied before the lost
// events of their keys (docs/guarantees.md).
func TestFailoverBehindOneAddress_Parallel(t *testing.T) {
	t.Parallel()
	failoverBehindOneAddress(t, parallelSub, true)
}

// TestFailoverBehindOneAddress_Franz: the same with the franz-go
// subscriber, whose next write of its position (before its next Kafka
// commit) finds the new timeline, stops handing out its partitions'
// records and, in its poll loop, starts them again from the promoted
// standby's position (SetOffsets), without leaving the group.
func TestFailoverBehindOneAddress_Franz(t *testing.T) {
	t.Parallel()
	failoverBehindOneAddress(t, franzSub, true)
}

// TestFailoverBehindOneAddressIdle_Franz: no event follows the move, so
// the member has no position to write; its idle check of the timeline
// (once per CommitInterval) finds the promotion and the lost events are
// processed again all the same, in key order (nothing new was handed out
// before them).
func TestFailoverBehindOneAddressIdle_Franz(t *testing.T) {
	t.Parallel()
	failoverBehindOneAddress(t, franzSub, false)
}

// failoverBehindOneAddress moves the running consumers' address; with
// traffic, new events follow the move.
func failoverBehindOneAddress(t *testing.T, k kind, traffic bool) {
	env := pgcluster.New(t)
	r := newRig(t, k)
	primary := env.Primary("primary", "")
	r.setup(primary)
	standby := primary.Standby("standby")
	addr := env.Proxy(primary)

	r.produce(perPhase)
	r.consume(addr)
	r.waitApplied(primary, time.Minute)
	r.waitProgress(primary)
	standby.CaughtUp(primary)

	standby.CutReplication()
	r.produce(perPhase)
	r.waitApplied(primary, time.Minute)
	r.waitCommitted()
	primary.StopImmediate()
	standby.Promote()
	lost := r.total - count(t, standby, "SELECT count(*) FROM applied")
	require.Positive(t, lost, "the cut left the standby behind")
	addr.PointTo(standby)
	t.Logf("the promoted standby lacks %d of %d events; the consumers' address now leads to it", lost, r.total)

	if traffic {
		r.produce(keys * 5)
	}
	r.waitApplied(standby, time.Minute)
	r.check(standby, !traffic)
	t.Logf("%d events applied before an earlier event of their key", count(t, standby, `SELECT count(*) FROM (
		SELECT seq, row_number() OVER (PARTITION BY key ORDER BY n) AS rn FROM applied) s WHERE seq <> rn`))
}
