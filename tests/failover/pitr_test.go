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
	pitr(t, parallelSub, 55436)
}

// TestPointInTimeRestore_WatermillKafka: the same with watermill-kafka's
// subscriber, after the operator's rewind.
func TestPointInTimeRestore_WatermillKafka(t *testing.T) {
	t.Parallel()
	pitr(t, watermillSub, 55438)
}

func pitr(t *testing.T, k kind, port int) {
	env := pgcluster.New(t)
	r := newRig(t, k)
	archive := env.Dir("archive")
	primary := env.Primary("primary", port, archive)
	r.setup(primary)
	backup := primary.BaseBackup("restored")

	r.produce(perPhase)
	stop := r.consume(primary)
	r.waitApplied(primary, time.Minute)
	r.waitProgress(primary)
	target := primary.LSN()

	r.produce(perPhase)
	r.waitApplied(primary, time.Minute)
	r.waitCommitted()
	stop()
	primary.Archived()
	primary.StopImmediate()

	restored := env.Restore(backup, port+1, archive, target)
	lost := r.total - count(t, restored, "SELECT count(*) FROM applied")
	require.Positive(t, lost, "the restore went back in time")
	t.Logf("the database restored to %s lacks %d of %d events", target, lost, r.total)
	if k == watermillSub {
		ahead := r.moveTo(restored)
		t.Logf("Kafka's committed offsets were %d ahead of PostgreSQL's position", ahead)
		if !kafkaOnly {
			require.GreaterOrEqual(t, ahead, int64(lost))
		}
	}
	r.consume(restored)
	r.produce(keys * 5)
	r.waitApplied(restored, 45*time.Second)
	r.check(restored)
}
