package orm

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// SQLXHandler records the payment with sqlx on the message's transaction:
// a sqlx.Tx around the *sql.Tx, with db's mapper (struct tags "db").
func SQLXHandler(db *sqlx.DB) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ev, err := decode(msg)
		if err != nil {
			return err
		}
		return idem.CompleteSQL(msg.Context(), func(ctx context.Context, stx *sql.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			tx := &sqlx.Tx{Tx: stx, Mapper: db.Mapper}
			_, err := tx.ExecContext(ctx, db.Rebind("INSERT INTO payments (event_id, order_id, amount) VALUES (?, ?, ?)"), id.String(), ev.OrderID, ev.Amount)
			return err
		})
	}
}
