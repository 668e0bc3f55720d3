package console

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// actions are the changes the console can make: what they ask before, and
// what they run.
var actions = map[string]struct {
	fields   []string
	question func(f map[string]string) string
	run      func(ctx context.Context, c *ops.Reader, f map[string]string) (string, error)
}{
	"unblock": {
		fields: []string{"group", "key"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Send the first event of key %q (consumer group %q) to the retry path again? A copy still on its way then runs as a duplicate, which the claim absorbs.", f["key"], f["group"])
		},
		run: func(ctx context.Context, c *ops.Reader, f map[string]string) (string, error) {
			return unblock(ctx, c, f["group"], f["key"], false)
		},
	},
	"skip": {
		fields: []string{"group", "key"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Remove the first event of key %q (consumer group %q) unapplied and hand the key to its next event? The removed event is neither applied nor poisoned: replay it.", f["key"], f["group"])
		},
		run: func(ctx context.Context, c *ops.Reader, f map[string]string) (string, error) {
			return unblock(ctx, c, f["group"], f["key"], true)
		},
	},
	"release": {
		fields: []string{"event_id", "group"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Release the lease of event %q (consumer group %q)? Its next delivery then runs at once; an owner still calling writes nothing (its call stands, under the same Idempotency-Key).", f["event_id"], f["group"])
		},
		run: func(ctx context.Context, c *ops.Reader, f map[string]string) (string, error) {
			return release(ctx, c, f["event_id"], f["group"])
		},
	},
	"forget": {
		fields: []string{"group"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Delete every claim and the registration of consumer group %q? A consumer started again under that name applies every event it reads again.", f["group"])
		},
		run: func(ctx context.Context, c *ops.Reader, f map[string]string) (string, error) {
			tc, err := c.TableConfig(ctx)
			if err != nil {
				return "", err
			}
			n, err := ops.ForgetGroup(ctx, c.Pool, tc, f["group"])
			if err != nil {
				return "", err
			}
			return ops.ForgotGroup(f["group"], n), nil
		},
	},
}

// unblock is the parked page's unblock and skip (idemctl retry unblock).
func unblock(ctx context.Context, c *ops.Reader, group, key string, skip bool) (string, error) {
	ob, err := outbox.New(c.Outbox, nil)
	if err != nil {
		return "", err
	}
	res, err := retrytopic.Unblock(ctx, c.Pool, ob, c.Parked, group, key, &retrytopic.UnblockOpts{Skip: skip})
	if err != nil {
		return "", err
	}
	return ops.Unblocked(res), nil
}

// release is the leases page's release (idemctl dedup release).
func release(ctx context.Context, c *ops.Reader, eventID, group string) (string, error) {
	tc, err := c.TableConfig(ctx)
	if err != nil {
		return "", err
	}
	id, ok, err := ops.ReleaseLease(ctx, c.Pool, tc, eventID, group)
	if err != nil {
		return "", err
	}
	if !ok {
		return "", fmt.Errorf("%s: %w", ops.NoLease(id, group), ops.ErrNotFound)
	}
	return fmt.Sprintf("released the lease of %s for %s", id, group), nil
}
