package failover_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
)

// TestFailoverToAsyncStandby_Parallel: the parallel subscriber starts from
// PostgreSQL's position on the promoted standby, so the events whose
// transactions the standby never received are processed again.
func TestFailoverToAsyncStandby_Parallel(t *testing.T) {
	t.Parallel()
	failover(t, parallelSub, false)
}

// TestFailoverToAsyncStandby_Franz: the franz-go subscriber (classic
// cooperative-sticky) starts every partition from PostgreSQL's position on
// the promoted standby (AdjustFetchOffsetsFn), so the events whose
// transactions the standby never received are processed again.
func TestFailoverToAsyncStandby_Franz(t *testing.T) {
	t.Parallel()
	failover(t, franzSub, false)
}

// TestFailoverToAsyncStandby_FranzKIP848: the same on the KIP-848
// consumer protocol, whose assignments the broker makes.
func TestFailoverToAsyncStandby_FranzKIP848(t *testing.T) {
	t.Parallel()
	failover(t, franzKIP848, false)
}

// TestFailoverToAsyncStandby_WatermillKafka: watermill-kafka's subscriber
// cannot be told where to start; the operator's comparison finds the
// committed offsets ahead of the promoted standby's position, and the
// rewind moves them back before the consumers start.
func TestFailoverToAsyncStandby_WatermillKafka(t *testing.T) {
	t.Parallel()
	failover(t, watermillSub, false)
}

// TestFailoverToAsyncStandby_WatermillKafkaProgress: with
// idemkafka.ClientConfig.Progress, watermill-kafka's subscriber commits to
// Kafka only the offsets PostgreSQL holds, and starts every claim from
// PostgreSQL's position: on the promoted standby the lost events are read
// again with no operator step.
func TestFailoverToAsyncStandby_WatermillKafkaProgress(t *testing.T) {
	t.Parallel()
	failover(t, watermillProgress, false)
}

// TestFailoverToAsyncStandby_WatermillKafkaGroupCommit: the same with the
// middleware's group commit, whose shared transaction records the position
// of every partition in its group.
func TestFailoverToAsyncStandby_WatermillKafkaGroupCommit(t *testing.T) {
	t.Parallel()
	failover(t, watermillGroupCommit, false)
}

// TestFailoverToAsyncStandby_WatermillKafkaRestartedFirst: the consumers
// restart on the promoted standby before the operator acts. The middleware
// counts and logs the records they skipped past PostgreSQL's position and
// keeps that position, so the rewind done afterwards still applies every
// lost event, once. Key order is not asserted: the events that flowed
// before the rewind were applied before the lost ones of their keys.
func TestFailoverToAsyncStandby_WatermillKafkaRestartedFirst(t *testing.T) {
	t.Parallel()
	failover(t, watermillSub, true)
}

// failover: events flow to a primary whose asynchronous standby follows;
// replication is cut; more events are processed and their offsets
// committed to Kafka; the primary dies (immediate stop); the standby is
// promoted and the consumers move to it; every event ends up applied once.
func failover(t *testing.T, k kind, restartFirst bool) {
	env := pgcluster.New(t)
	r := newRig(t, k)
	primary := env.Primary("primary", "")
	r.setup(primary)
	standby := primary.Standby("standby")

	r.produce(perPhase)
	stop, _ := r.consume(primary)
	r.waitApplied(primary, time.Minute)
	r.waitProgress(primary)
	standby.CaughtUp(primary)

	standby.CutReplication()
	r.produce(perPhase)
	r.waitApplied(primary, time.Minute)
	r.waitCommitted() // Kafka's offsets are past every event
	stop()
	primary.StopImmediate()
	standby.Promote()
	lost := r.total - count(t, standby, "SELECT count(*) FROM applied")
	require.Positive(t, lost, "the cut left the standby behind")
	t.Logf("the promoted standby lacks %d of %d events", lost, r.total)

	r.moveTo(standby, lost, restartFirst)
	r.produce(keys * 5) // traffic goes on
	r.waitApplied(standby, 45*time.Second)
	r.check(standby, !restartFirst)
}
