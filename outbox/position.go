package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
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

// PositionError is returned by [Forwarder.Run], [Outbox.Backlog] and
// [Outbox.DeleteForwarded] when a forwarder's position in a topic was not
// written on the running PostgreSQL cluster: its system identifier is
// another cluster's, or it has seen transaction ids that the running
// cluster has not reached. A position is a snapshot of one cluster's
// transaction ids: after a pg_dump/restore, or a move to a logically
// replicated copy, rows written on the new cluster would count as already
// forwarded (a backlog of 0, rows deleted unsent). idemctl outbox
// reposition resets the position so that every row still in the table is
// forwarded again. Match it with errors.As.
type PositionError struct {
	Topic, Forwarder string
	// StoredSystemID is the system identifier stored with the position (0
	// when unknown), SystemID the running cluster's.
	StoredSystemID, SystemID int64
	// StoredXmax bounds the transaction ids the position has seen, Xmax is
	// the running cluster's current xmax (full xid8 values).
	StoredXmax, Xmax uint64
}

func (e *PositionError) Error() string {
	what := fmt.Sprintf("its transaction ids are ahead of this cluster's (it has seen xmax %d; this cluster is at %d)", e.StoredXmax, e.Xmax)
	if e.StoredSystemID != 0 && e.StoredSystemID != e.SystemID {
		what = fmt.Sprintf("it was written on another PostgreSQL cluster (system identifier %d; this one is %d)", e.StoredSystemID, e.SystemID)
	}
	return fmt.Sprintf("outbox: position of %s in topic %s is from another cluster: %s; "+
		"the database was restored from a dump or moved to a logically replicated copy? Rows written here would count as already forwarded, "+
		"so nothing is forwarded, counted or deleted until the position is reset: list what would be re-sent with `idemctl outbox reposition --dry-run`, "+
		"then run `idemctl outbox reposition`, which forwards every row still in the table again",
		e.Forwarder, e.Topic, what)
}

// isPositionError reports whether err holds a [*PositionError]: a position
// no retry can fix.
func isPositionError(err error) bool {
	var pe *PositionError
	return errors.As(err, &pe)
}

// positionError returns err as a *PositionError of topic when it holds an
// outboxsql.ForeignError, else err.
func positionError(err error, topic string) error {
	var fe *outboxsql.ForeignError
	if !errors.As(err, &fe) {
		return err
	}
	return &PositionError{Topic: topic, Forwarder: fe.Name,
		StoredSystemID: fe.Stored.System, SystemID: fe.Current.System,
		StoredXmax: fe.Stored.Xmax, Xmax: fe.Current.Xmax}
}

// checkPosition returns a *PositionError when the forwarder's position in
// topic is from another cluster.
func (f *Forwarder) checkPosition(ctx context.Context, topic string) error {
	_, err := f.cfg.Outbox.tables(topic).Position(ctx, f.cfg.DB, f.cfg.Name)
	if errors.Is(err, outboxsql.ErrNoPosition) {
		return nil
	}
	if err != nil {
		if pe := positionError(err, topic); pe != err {
			return pe
		}
		return fmt.Errorf("outbox forwarder: read position in topic %q: %w", topic, err)
	}
	return nil
}
