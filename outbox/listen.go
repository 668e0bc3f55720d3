package outbox

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// listen wakes the topics' loops when a transaction that wrote to their
// tables commits: it LISTENs on each topic's channel (migration 2's trigger
// notifies it) on a connection of its own, opened with DB's connection
// settings. When the connection fails it reconnects after RetryInterval;
// meanwhile the loops poll.
func (f *Forwarder) listen(ctx context.Context, wake map[string]chan struct{}) {
	byChannel := make(map[string]chan struct{}, len(wake))
	for topic, ch := range wake {
		byChannel[f.cfg.Outbox.channel(topic)] = ch
	}
	signal := func(ch chan struct{}) {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	for ctx.Err() == nil {
		err := f.listenOnce(ctx, byChannel, signal)
		if ctx.Err() != nil {
			return
		}
		f.logger.Error("Outbox forwarder's LISTEN connection failed, polling until it is back", err, watermill.LogFields{"retry_in": f.cfg.RetryInterval.String()})
		if wait.Sleep(ctx, f.cfg.RetryInterval) != nil {
			return
		}
	}
}

func (f *Forwarder) listenOnce(ctx context.Context, byChannel map[string]chan struct{}, signal func(chan struct{})) error {
	conn, err := pgx.ConnectConfig(ctx, f.cfg.DB.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for ch := range byChannel {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			return fmt.Errorf("listen %s: %w", ch, err)
		}
	}
	// Commits before the LISTEN took effect sent nothing to this connection.
	for _, ch := range byChannel {
		signal(ch)
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if ch, ok := byChannel[n.Channel]; ok {
			signal(ch)
		}
	}
}
