package retrytopic

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// The reason of a message whose attempts ran out matches both the sentinel
// and the last failure, and names the attempts.
func TestExhaustedWrapsTheSentinelAndTheLastFailure(t *testing.T) {
	t.Parallel()
	last := errors.New("downstream 503")
	err := exhausted(3, last)
	require.ErrorIs(t, err, ErrAttemptsExhausted)
	require.ErrorIs(t, err, last)
	require.EqualError(t, err, "retry attempts exhausted after 3 retry-topic attempts: downstream 503")
}
