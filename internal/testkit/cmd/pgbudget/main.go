// Command pgbudget checks, before `make test` runs anything, that the
// PostgreSQL server of DATABASE_URL (default: pgtest.DefaultURL) accepts
// as many client connections as the test suite may hold at once (its
// connection budget, docs: README "Testing"). It exits 1 with the fix when
// it does not, or when the server cannot be reached.
//
//	go run ./internal/testkit/cmd/pgbudget -budget 60
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

func main() {
	budget := flag.Int("budget", 60, "client connections the test suite may hold at once")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	note, err := check(ctx, pgtest.URL(), *budget)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pgbudget:", err)
		os.Exit(1)
	}
	if note != "" {
		fmt.Fprintln(os.Stderr, "pgbudget:", note)
	}
}

// server is what check reads from the server.
type server struct {
	where                     string // host:port/database
	maxConns, reserved, inUse int
	superuserReserved         int
}

// check returns an error naming the fix when the server at url allows fewer
// than budget client connections (max_connections less the reserved
// slots), and a note when it allows enough but too many are in use already.
func check(ctx context.Context, url string, budget int) (note string, err error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "", fmt.Errorf("DATABASE_URL %q: %w", url, err)
	}
	s := server{where: fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return "", fmt.Errorf("cannot connect to PostgreSQL at %s: %w\n"+
			"Fix: start PostgreSQL there (README, \"Testing\"), or set DATABASE_URL to a server you can use", s.where, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// reserved_connections exists from PostgreSQL 16 on.
	err = conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(current_setting('reserved_connections', true), '0')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int`).
		Scan(&s.maxConns, &s.superuserReserved, &s.reserved, &s.inUse)
	if err != nil {
		return "", fmt.Errorf("read max_connections at %s: %w", s.where, err)
	}
	return s.verdict(budget)
}

func (s server) verdict(budget int) (string, error) {
	reserved := s.superuserReserved + s.reserved
	usable := s.maxConns - reserved
	if usable < budget {
		return "", fmt.Errorf("PostgreSQL at %s accepts %d client connections (max_connections=%d, %d reserved); "+
			"`make test` may hold up to %d at once.\n"+
			"Fix: raise max_connections to at least %d (ALTER SYSTEM SET max_connections = %d; then restart PostgreSQL), "+
			"or set DATABASE_URL to a server that accepts %d",
			s.where, usable, s.maxConns, reserved, budget, budget+reserved, budget+reserved, budget)
	}
	if free := usable - s.inUse; free < budget {
		return fmt.Sprintf("note: %d of %d connections at %s are in use by others, %d free; the suite may need %d "+
			"(too many clients: SQLSTATE 53300)", s.inUse, usable, s.where, free, budget), nil
	}
	return "", nil
}
