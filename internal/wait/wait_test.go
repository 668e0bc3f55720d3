package wait_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/wait"
)

func TestSleep(t *testing.T) {
	if err := wait.Sleep(context.Background(), time.Millisecond); err != nil {
		t.Fatalf("a whole wait: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := wait.Sleep(ctx, time.Hour); !errors.Is(err, context.Canceled) {
		t.Fatalf("an ended context ends the wait at once: %v", err)
	}
	if err := wait.Sleep(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("no wait, an ended context: %v", err)
	}
}
