package deduplicator

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
)

// The mismatch names the command that changes the recorded retention for
// every component: idemctl retention set (there is no `idemctl dedup
// retention`; the message named it before).
func TestRetentionMismatchNamesTheCommandThatExists(t *testing.T) {
	t.Parallel()
	cfg := TableConfig{Retention: 24 * time.Hour}
	cfg.setDefaults()
	err := checkRetention(dedupsql.Setting{Retention: DefaultRetention}, cfg)
	if !errors.Is(err, ErrRetentionMismatch) {
		t.Fatalf("got %v, want ErrRetentionMismatch", err)
	}
	for _, want := range []string{"idemctl retention set", "records 168h0m0s, configured 24h0m0s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not name %q", err, want)
		}
	}
}
