package claimstart_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/claimstart"
)

func TestLookupReturnsTheLatestClaimOfItsGroup(t *testing.T) {
	_, ok := claimstart.Lookup("cs-a", "orders", 0)
	require.False(t, ok)
	claimstart.Record("cs-a", "orders", 0, 10)
	claimstart.Record("cs-b", "orders", 0, 99)
	first, ok := claimstart.Lookup("cs-a", "orders", 0)
	require.True(t, ok)
	require.EqualValues(t, 10, first.Offset)
	claimstart.Record("cs-a", "orders", 0, 10) // the partition given back: a new claim
	again, _ := claimstart.Lookup("cs-a", "orders", 0)
	require.EqualValues(t, 10, again.Offset)
	require.NotEqual(t, first.Claim, again.Claim)
	other, _ := claimstart.Lookup("cs-b", "orders", 0)
	require.EqualValues(t, 99, other.Offset)
}
