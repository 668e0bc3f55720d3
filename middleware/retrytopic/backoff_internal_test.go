package retrytopic

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBackoffDelay(t *testing.T) {
	t.Parallel()
	b := Backoff{Initial: time.Second, Multiplier: 3, Max: 20 * time.Second, Jitter: 0.25}
	// r = 0.5 is the middle of the jitter range: the bare exponential.
	for attempt, want := range map[int]time.Duration{0: time.Second, 1: time.Second, 2: 3 * time.Second, 3: 9 * time.Second, 4: 20 * time.Second, 1000: 20 * time.Second} {
		require.Equal(t, want, b.delay(attempt, 0.5), "attempt %d", attempt)
	}
	// The jitter spreads the delay over [d·(1−J), d·(1+J)].
	require.Equal(t, 6750*time.Millisecond, b.delay(3, 0))
	require.InDelta(t, float64(11250*time.Millisecond), float64(b.delay(3, 0.999999999)), float64(time.Microsecond))
	// The cap applies before the jitter.
	require.Equal(t, 15*time.Second, b.delay(50, 0))

	var d Backoff
	d.setDefaults()
	require.Equal(t, Backoff{Initial: defaultInitialDelay, Multiplier: defaultMultiplier, Max: defaultMaxDelay, Jitter: defaultJitter}, d)
	for range 1000 {
		got := d.randomDelay(2)
		require.GreaterOrEqual(t, got, 1600*time.Millisecond)
		require.LessOrEqual(t, got, 2400*time.Millisecond)
	}
	none := Backoff{Jitter: NoJitter}
	none.setDefaults()
	require.Equal(t, 4*time.Second, none.delay(3, 0), "NoJitter")
	// The default multiplier without jitter: exponential, capped.
	capped := Backoff{Initial: time.Second, Max: 10 * time.Second, Jitter: NoJitter}
	for attempt, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second} {
		require.Equal(t, want, capped.randomDelay(attempt+1), "attempt %d", attempt+1)
	}
}

func TestConfigTopicOfAttempt(t *testing.T) {
	t.Parallel()
	c := Config{Topics: []string{"r1", "r2"}}
	require.Equal(t, "r1", c.topic(0))
	require.Equal(t, "r1", c.topic(1))
	require.Equal(t, "r2", c.topic(2))
	require.Equal(t, "r2", c.topic(9), "the last topic takes every further attempt")
}
