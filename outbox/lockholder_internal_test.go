package outbox

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// transaction_timeout exists from PostgreSQL 17 on (the suite's server may
// be older): the start-up check flags one shorter than a transaction's
// sends, and says nothing of one long enough.
func TestTimeoutNotes(t *testing.T) {
	cfg := ForwarderConfig{}
	cfg.setDefaults() // SendTimeout 30 s, BatchesPerTransaction 4

	notes := timeoutNotes(cfg, map[string]time.Duration{"transaction_timeout": time.Minute})
	require.Len(t, notes, 1)
	require.True(t, notes[0].bad)
	require.Contains(t, notes[0].text, "transaction_timeout (1m0s) is shorter than a forwarder transaction may last (BatchesPerTransaction 4 × SendTimeout 30s = 2m0s)")

	require.Empty(t, timeoutNotes(cfg, map[string]time.Duration{"transaction_timeout": 5 * time.Minute, "idle_in_transaction_session_timeout": time.Hour}))

	notes = timeoutNotes(cfg, map[string]time.Duration{"idle_in_transaction_session_timeout": 10 * time.Second})
	require.Len(t, notes, 1)
	require.False(t, notes[0].bad)
	require.Contains(t, notes[0].text, "set their own (35s")

	cfg.SendTimeout = -1
	notes = timeoutNotes(cfg, nil)
	require.Len(t, notes, 1)
	require.True(t, strings.Contains(notes[0].text, "keeps the position's lock"))
}
