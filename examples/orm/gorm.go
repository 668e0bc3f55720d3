package orm

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"gorm.io/gorm"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// GORMPayment is the GORM model of a payments row.
type GORMPayment struct {
	EventID string `gorm:"primaryKey"`
	OrderID string
	Amount  int64
}

// TableName maps the model to the payments table.
func (GORMPayment) TableName() string { return "payments" }

// GORMHandler records the payment with GORM on the message's transaction:
// a session of db whose connection pool is the *sql.Tx (what gorm.DB.Begin
// does with a transaction of its own).
func GORMHandler(db *gorm.DB) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ev, err := decode(msg)
		if err != nil {
			return err
		}
		return idem.CompleteSQL(msg.Context(), func(ctx context.Context, stx *sql.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			tx := db.Session(&gorm.Session{Context: ctx, NewDB: true})
			tx.Statement.ConnPool = stx
			return tx.Create(&GORMPayment{EventID: id.String(), OrderID: ev.OrderID, Amount: ev.Amount}).Error
		})
	}
}
