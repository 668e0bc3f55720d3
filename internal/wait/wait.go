// Package wait holds the library's one "sleep unless the context ends".
package wait

import (
	"context"
	"time"
)

// Sleep waits d, or until ctx ends, and then returns ctx.Err() (nil when
// the whole wait passed). d <= 0 returns at once.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
