package outbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
)

// recreatePosition registers the forwarder's position in topic again
// after it went missing (an operator deleted the row, to force a
// re-forward): at the start of the table, as at the first registration,
// so every row still in it is forwarded again. It logs that once per
// deletion.
func (f *Forwarder) recreatePosition(ctx context.Context, topic string, logger watermill.LoggerAdapter) error {
	if err := f.register(ctx, topic); err != nil {
		return err
	}
	logger.Info("Outbox forwarder's position was missing (deleted?): recreated at the start of the table, every row still in it is forwarded again", nil)
	return nil
}
