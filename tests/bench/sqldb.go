package bench

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() {
	Register("dedup-sqldb", dedupSQLDB)
}

// openSQLDB opens a *sql.DB with pgx's stdlib driver on schema, of at most
// maxConns connections, that never pings a connection it reuses; rt, when
// not nil, counts its round trips.
func openSQLDB(o Options, schema string, maxConns int, rt *rtcount.Counter) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["search_path"] = schema
	if rt != nil {
		cfg.DialFunc = rt.DialFunc()
	}
	sdb := stdlib.OpenDB(*cfg, stdlib.OptionShouldPing(func(context.Context, stdlib.ShouldPingParams) bool { return false }))
	sdb.SetMaxOpenConns(maxConns)
	sdb.SetMaxIdleConns(maxConns)
	return sdb, nil
}

// sqlDedup is the dedup rig's middleware on a *sql.DB of its schema, around
// the same business write made through the *sql.Tx.
func (r *dedupRig) sqlDedup(sdb *sql.DB) (message.HandlerFunc, error) {
	db, err := idem.SQLDB(sdb)
	if err != nil {
		return nil, err
	}
	d, err := idem.NewDedup(idem.Config{DB: db, ConsumerGroup: "bench-sql", Table: r.table}, nil)
	if err != nil {
		return nil, err
	}
	return d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		_, err := idem.MustSQLTxFromContext(ctx).ExecContext(ctx, businessSQL, msg.UUID, int64(len(msg.Payload)))
		return nil, err
	}), nil
}

// dedupSQLDB compares the dedup middleware on a *sql.DB (idem.SQLDB, the
// handler writing through the *sql.Tx) with the same on a pgx pool.
func dedupSQLDB(ctx context.Context, o Options) (Section, error) {
	rig, err := newDedupRig(ctx, o, "sqldb", 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer rig.close()
	sdb, err := openSQLDB(o, rig.db.Schema, 16, nil)
	if err != nil {
		return Section{}, err
	}
	defer sdb.Close()
	onSQL, err := rig.sqlDedup(sdb)
	if err != nil {
		return Section{}, err
	}
	rounds, d := 2*o.Rounds, measureFor(o, 400*time.Millisecond, 150*time.Millisecond)
	ops := []func(context.Context) error{freshOp(rig.deduped, nil), freshOp(onSQL, nil)}
	if _, err := Interleave(ctx, 1, 16, 300*time.Millisecond, ops...); err != nil {
		return Section{}, err
	}
	var rows [][]string
	for _, w := range []int{1, 16} {
		rates, err := Interleave(ctx, rounds, w, d, ops...)
		if err != nil {
			return Section{}, err
		}
		st := Summarise(Ratios(rates[0], rates[1]))
		o.Logf("  dedup-sqldb workers=%d: pgx pool %s msg/s, *sql.DB %s msg/s, ratio %s", w, fmtRate(rates[0]), fmtRate(rates[1]), st)
		rows = append(rows, []string{fmt.Sprint(w), fmtRate(rates[0]), fmtRate(rates[1]), st.String(), pass(st.Median >= 0.90)})
	}
	rts, err := sqlRoundTrips(ctx, o)
	if err != nil {
		return Section{}, err
	}
	var b strings.Builder
	b.WriteString(Table([]string{"workers", "dedup on a pgx pool (msg/s, median)", "dedup on a *sql.DB (msg/s, median)", "ratio sql/pgx", "median ≥ 0.90"}, rows))
	fmt.Fprintf(&b, "\nBaseline: the dedup middleware on a `*pgxpool.Pool`, the handler writing one business row through `idem.MustTxFromContext`. "+
		"Subject: the same middleware on a `*sql.DB` opened with pgx's stdlib driver (`idem.SQLDB`), the handler writing the same row through "+
		"the `*sql.Tx` (`idem.MustSQLTxFromContext`), as a GORM, bun, ent, sqlx or sqlc handler does. Both pools hold 16 connections. "+
		"Interleaved call by call as above; %d rounds of %s.\n\n", rounds, d)
	b.WriteString(Table([]string{"database", "dedup, first-time", "dedup, duplicate"}, rts))
	b.WriteString("\nPostgreSQL round trips per message, counted at the net.Conn level, averaged over 20 messages on a warm connection. " +
		"database/sql sends BEGIN on its own (a driver cannot queue a statement behind it), so BEGIN and the claim take two round trips " +
		"where pgx pipelines them in one. Asserted exactly in `middleware/sqldb_test.go`.\n")
	return Section{Title: "Dedup on a *sql.DB (database/sql, pgx stdlib) vs on a pgx pool", Markdown: b.String()}, nil
}

// sqlRoundTrips counts round trips per message on one counted connection,
// on a pgx pool and on a *sql.DB.
func sqlRoundTrips(ctx context.Context, o Options) ([][]string, error) {
	rt := &rtcount.Counter{}
	rig, err := newDedupRig(ctx, o, "sqldb_rt", 1, func(c *pgxpool.Config) { c.ConnConfig.DialFunc = rt.DialFunc() })
	if err != nil {
		return nil, err
	}
	defer rig.close()
	sdb, err := openSQLDB(o, rig.db.Schema, 1, rt)
	if err != nil {
		return nil, err
	}
	defer sdb.Close()
	onSQL, err := rig.sqlDedup(sdb)
	if err != nil {
		return nil, err
	}
	var rows [][]string
	for _, v := range []struct {
		name string
		h    message.HandlerFunc
	}{{"pgx pool", rig.deduped}, {"*sql.DB (pgx stdlib)", onSQL}} {
		warm := uuid.Must(uuid.NewV7())
		for range 2 {
			if _, err := v.h(eventMessage(ctx, warm)); err != nil {
				return nil, err
			}
		}
		const n = 20
		ids := make([]uuid.UUID, n)
		rt.Reset()
		for i := range ids {
			ids[i] = uuid.Must(uuid.NewV7())
			if _, err := v.h(eventMessage(ctx, ids[i])); err != nil {
				return nil, err
			}
		}
		first := float64(rt.Load()) / n
		rt.Reset()
		for _, id := range ids {
			if _, err := v.h(eventMessage(ctx, id)); err != nil {
				return nil, err
			}
		}
		dup := float64(rt.Load()) / n
		o.Logf("  dedup-sqldb round trips %s: first-time %.1f, duplicate %.1f", v.name, first, dup)
		rows = append(rows, []string{v.name, fmt.Sprintf("%g", first), fmt.Sprintf("%g", dup)})
	}
	return rows, nil
}
