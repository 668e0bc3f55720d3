package orm

import (
	"context"
	"database/sql"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// EntHandler records the payment with ent's SQL driver and builder on the
// message's transaction: entsql.Conn over the *sql.Tx is an ent driver
// (dialect.Driver); a generated ent client takes the same driver
// (ent.NewClient(ent.Driver(drv))).
func EntHandler() message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ev, err := decode(msg)
		if err != nil {
			return err
		}
		return idem.CompleteSQL(msg.Context(), func(ctx context.Context, tx *sql.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			drv := entsql.NewDriver(dialect.Postgres, entsql.Conn{ExecQuerier: tx})
			query, args := entsql.Dialect(dialect.Postgres).
				Insert("payments").
				Columns("event_id", "order_id", "amount").
				Values(id.String(), ev.OrderID, ev.Amount).
				Query()
			return drv.Exec(ctx, query, args, nil)
		})
	}
}
