package failover_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgcluster"
)

// TestPointInTimeRestore_Parallel: the database is restored from a base
// backup and its WAL archive to a point between two batches of events
// whose offsets Kafka has committed; the parallel subscriber, moved to the
// restored database, processes the second batch again.
func TestPointInTimeRestore_Parallel(t *testing.T) {
	t.Parallel()
	pitr(t, parallelSub)
}

// TestPointInTimeRestore_Franz: the same with the franz-go subscriber.
func TestPointInTimeRestore_Franz(t *testing.T) {
	t.Parallel()
	pitr(t, franzSub)
}

// TestPointInTimeRestore_WatermillKafka: the same with watermill-kafka's
// subscriber, after the operator's rewind.
func TestPointInTimeRestore_WatermillKafka(t *testing.T) {
	t.Parallel()
	pitr(t, watermillSub)
}

// TestPointInTimeRestore_WatermillKafkaProgress: the same for
// watermill-kafka's subscriber with idemkafka.ClientConfig.Progress, with
// no operator step.
func TestPointInTimeRestore_WatermillKafkaProgress(t *testing.T) {
	t.Parallel()
	pitr(t, watermillProgress)
}

func pitr(t *testing.T, k kind) {
	env := pgcluster.New(t)
	r := newRig(t, k)
	archive := env.Dir("archive")
	primary := env.Primary("primary", archive)
	r.setup(primary)
	backup := primary.BaseBackup("restored")

	r.produce(perPhase)
	stop, _ := r.consume(primary)
	r.waitApplied(primary, time.Minute)
	r.waitProgress(primary)
	target := primary.LSN()

	r.produce(perPhase)
	r.waitApplied(primary, time.Minute)
	r.waitCommitted()
	stop()
	primary.Archived()
	primary.StopImmediate()

	restored := env.Restore(backup, archive, target)
	lost := r.total - count(t, restored, "SELECT count(*) FROM applied")
	require.Positive(t, lost, "the restore went back in time")
	t.Logf("the database restored to %s lacks %d of %d events", target, lost, r.total)
	r.moveTo(restored, lost, false)
	r.produce(keys * 5)
	r.waitApplied(restored, 45*time.Second)
	r.check(restored, true)
}
