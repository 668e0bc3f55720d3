package orm

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/uptrace/bun"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// BunPayment is the bun model of a payments row.
type BunPayment struct {
	bun.BaseModel `bun:"table:payments"`

	EventID string `bun:"event_id,pk"`
	OrderID string `bun:"order_id"`
	Amount  int64  `bun:"amount"`
}

// BunHandler records the payment with bun (pgdialect, over the same
// *sql.DB) on the message's transaction: the *sql.Tx is the query's
// bun.IConn.
func BunHandler(db *bun.DB) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ev, err := decode(msg)
		if err != nil {
			return err
		}
		return idem.CompleteSQL(msg.Context(), func(ctx context.Context, tx *sql.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			_, err := db.NewInsert().Conn(tx).
				Model(&BunPayment{EventID: id.String(), OrderID: ev.OrderID, Amount: ev.Amount}).
				Exec(ctx)
			return err
		})
	}
}
