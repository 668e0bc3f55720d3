package retrytopic

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// SetWaitHook sets the hook wait runs between its INSERT and its COMMIT,
// with the event id (nil removes it). Set it only from a test that is not
// parallel: the other tests are not running then.
func SetWaitHook(f func(id uuid.UUID)) { testHookWaitBeforeCommit = f }

// Wait parks event id of key behind its key's head, as a main-topic
// follower does: queued is false when the key is free.
func Wait(ctx context.Context, r *RetryTopic, key string, id uuid.UUID, msg *message.Message) (bool, error) {
	return r.order.wait(ctx, &parking{group: r.order.cfg.ConsumerGroup, key: key, id: id}, msg)
}

// ReleaseTx releases event id of key on tx, as ReleaseMiddleware does in
// the handler's transaction, and reports whether it handed the key on.
func ReleaseTx(ctx context.Context, r *RetryTopic, tx pgx.Tx, key string, id uuid.UUID) (bool, error) {
	pk := &parking{group: r.order.cfg.ConsumerGroup, key: key, id: id}
	err := r.order.release(ctx, tx, pk)
	return pk.handedOff.Load(), err
}
