package outbox

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/sqltx"
)

// execer runs the outbox's INSERT: a pgx.Tx, or a *sql.Tx (sqlExec).
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// SQLPublisher is [Outbox.Publisher] on a database/sql transaction of a
// *sql.DB opened with pgx's stdlib driver (the one a handler gets from
// idem.SQLTxFromContext, or any GORM, bun, ent, sqlx or sqlc transaction):
// the rows commit or vanish with tx. Each message is stamped with its own
// context. On the dedup middleware's transaction the forwarders are woken
// after its COMMIT, as on a pgx.Tx; on another they start looking at once.
func (o *Outbox) SQLPublisher(tx *sql.Tx) message.Publisher {
	return &sqlPublisher{o: o, tx: tx}
}

type sqlPublisher struct {
	o  *Outbox
	tx *sql.Tx
}

func (p *sqlPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	// The middleware's own transaction: write through its pgx.Tx (the same
	// session), so the wake-up waits for its COMMIT.
	if v := idemctx.From(ctx); v != nil && v.Tx != nil {
		if stx, ok := sqltx.SQL(v.Tx); ok && stx == p.tx {
			return p.o.write(ctx, v.Tx, topic, msgs, nil)
		}
	}
	return p.o.write(ctx, sqlExec{p.tx}, topic, msgs, nil)
}

func (p *sqlPublisher) Close() error { return nil }

// sqlExec runs statements on a *sql.Tx. pgx's stdlib driver hands the
// arguments to pgx unchanged, so they are encoded as on a pgx.Tx.
type sqlExec struct{ tx *sql.Tx }

func (e sqlExec) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	_, err := e.tx.ExecContext(ctx, query, args...)
	return pgconn.CommandTag{}, err
}
