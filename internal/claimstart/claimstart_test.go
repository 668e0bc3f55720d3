package claimstart_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/claimstart"
)

func TestLookupReturnsTheLatestClaimOfItsGroup(t *testing.T) {
	_, ok := claimstart.Lookup("cs-a", "orders", 0)
	require.False(t, ok)
	claimstart.Record("cs-a", "orders", 0, 10, false)
	claimstart.Record("cs-b", "orders", 0, 99, false)
	first, ok := claimstart.Lookup("cs-a", "orders", 0)
	require.True(t, ok)
	require.EqualValues(t, 10, first.Offset)
	claimstart.Record("cs-a", "orders", 0, 10, false) // the partition given back: a new claim
	again, _ := claimstart.Lookup("cs-a", "orders", 0)
	require.EqualValues(t, 10, again.Offset)
	require.NotEqual(t, first.Claim, again.Claim)
	other, _ := claimstart.Lookup("cs-b", "orders", 0)
	require.EqualValues(t, 99, other.Offset)
}

// A retry topic's subscriber in a Kafka group of its own, behind a dedup
// middleware of the main group: the one Kafka group holding the partition
// answers; two groups on it leave the answer unknown.
func TestLookupFallsBackToTheOneGroupHoldingThePartition(t *testing.T) {
	claimstart.Record("cs-main-retry1", "cs-orders-retry1", 2, 40, false)
	s, ok := claimstart.Lookup("cs-main", "cs-orders-retry1", 2)
	require.True(t, ok)
	require.EqualValues(t, 40, s.Offset)
	_, ok = claimstart.Lookup("cs-main", "cs-orders-retry1", 3)
	require.False(t, ok, "no claim of that partition")
	claimstart.Record("cs-other-retry1", "cs-orders-retry1", 2, 7, false)
	_, ok = claimstart.Lookup("cs-main", "cs-orders-retry1", 2)
	require.False(t, ok, "two Kafka groups hold it: which one the message came from is not known")
	s, ok = claimstart.Lookup("cs-other-retry1", "cs-orders-retry1", 2)
	require.True(t, ok, "its own group's claim still answers")
	require.EqualValues(t, 7, s.Offset)
}

// Started records the claim and calls, before it returns, the writers
// watching its Kafka group, the latest of each owner only.
func TestStartedCallsTheWatchersOfItsGroup(t *testing.T) {
	var got []string
	watch := func(name string) claimstart.StartFunc {
		return func(_ context.Context, topic string, partition int32, offset int64) {
			got = append(got, fmt.Sprintf("%s %s/%d@%d", name, topic, partition, offset))
		}
	}
	claimstart.Watch("cs-w", "owner1", watch("replaced"))
	claimstart.Watch("cs-w", "owner1", watch("one"))
	claimstart.Watch("cs-other", "owner2", watch("other"))
	claimstart.Started(context.Background(), "cs-w", "retry", 2, 7, false)
	require.Equal(t, []string{"one retry/2@7"}, got)
	s, ok := claimstart.Lookup("cs-w", "retry", 2)
	require.True(t, ok)
	require.EqualValues(t, 7, s.Offset)
	require.False(t, s.Kept)

	// A claim whose subscriber keeps the position itself is recorded, and
	// handed to no writer.
	claimstart.Started(context.Background(), "cs-w", "retry", 3, 9, true)
	require.Equal(t, []string{"one retry/2@7"}, got)
	s, ok = claimstart.Lookup("cs-w", "retry", 3)
	require.True(t, ok)
	require.True(t, s.Kept)
}
