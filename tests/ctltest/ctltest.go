// Package ctltest runs the idemctl binary for tests: cmd/idemctl's own and
// the console's browser tests (tests/browser, a module of its own). It
// builds the binary once, runs it on a test's schema, starts `idemctl serve`,
// and seeds the tables the console shows.
//
// It imports the library's public packages to seed tables, so it stands
// with the harnesses in tests/ (the top floor of docs/floors.md), not in
// internal/.
package ctltest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Token is the actions' token of the tests (IDEMCTL_TOKEN).
const Token = "s3cret-token-for-tests-0123456789"

// Binary is the path of a built idemctl.
type Binary string

// Build builds the idemctl package pkg (a directory or an import path) into
// dir with the go command's extra flags (-race), and returns the binary.
func Build(dir, pkg string, flags ...string) (Binary, error) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("go not in PATH: %w", err)
	}
	bin := filepath.Join(dir, "idemctl")
	build := exec.Command(goBin, append(append([]string{"build"}, flags...), "-o", bin, pkg)...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("build idemctl: %w", err)
	}
	return Binary(bin), nil
}

// Main is a TestMain's body: it builds pkg into a temporary directory with
// flags, sets *bin, runs the tests and removes the directory. It returns
// the exit code (1 when the build fails).
func Main(m *testing.M, bin *Binary, pkg string, flags ...string) int {
	dir, err := os.MkdirTemp("", "idemctl-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if *bin, err = Build(dir, pkg, flags...); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

// Result is one run of the binary.
type Result struct {
	Stdout, Stderr string
	Code           int
}

func (r Result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.Code, r.Stdout, r.Stderr)
}

// environ is the process environment without the variables that would
// point idemctl elsewhere than the test says, plus env (KEY=value).
func environ(env []string, drop ...string) []string {
	var out []string
	for _, kv := range os.Environ() {
		keep := true
		for _, p := range append([]string{"DATABASE_URL=", "KAFKA_BROKERS=", "PG"}, drop...) {
			keep = keep && !strings.HasPrefix(kv, p)
		}
		if keep {
			out = append(out, kv)
		}
	}
	return append(out, env...)
}

// Run execs idemctl with args and env (KEY=value) on top of an environment
// without DATABASE_URL and KAFKA_BROKERS.
func (b Binary) Run(t testing.TB, env []string, args ...string) Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a hang guard, not a threshold
	defer cancel()
	cmd := exec.CommandContext(ctx, string(b), args...)
	cmd.Env = environ(env)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return Result{stdout.String(), stderr.String(), code}
}

// Ctl runs idemctl on db's schema (DATABASE_URL in the environment).
func (b Binary) Ctl(t testing.TB, db *pgtest.DB, args ...string) Result {
	t.Helper()
	return b.Run(t, []string{"DATABASE_URL=" + db.URL}, append(args, "--schema", db.Schema)...)
}

// OK runs Ctl and requires exit 0.
func (b Binary) OK(t testing.TB, db *pgtest.DB, args ...string) Result {
	t.Helper()
	r := b.Ctl(t, db, args...)
	require.Equal(t, 0, r.Code, "idemctl %s\n%s", strings.Join(args, " "), r)
	return r
}

// Migrated returns a test schema with the dedup table (in layout) and the
// outbox tables of topics migrated by idemctl itself.
func (b Binary) Migrated(t testing.TB, layout string, topics ...string) *pgtest.DB {
	t.Helper()
	db := pgtest.New(t, 4)
	args := []string{"migrate", "up", "--layout", layout}
	if len(topics) > 0 {
		args = append(args, "--topics", strings.Join(topics, ","))
	}
	b.OK(t, db, args...)
	return db
}

// ConsoleDB is a schema with the dedup table, the outbox topics orders
// and orders.retry, the parked-keys table, a registered group and claims.
func (b Binary) ConsoleDB(t testing.TB, layout string) *pgtest.DB {
	t.Helper()
	db := b.Migrated(t, layout, "orders", "orders.retry")
	require.NoError(t, migrate.Up(context.Background(), db.Pool, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema})))
	Claim(t, db, "billing", true, publisher.NewEventID(), publisher.NewEventID(), publisher.NewEventID())
	db.Exec(t, `ANALYZE processed_event`)
	return db
}

// StartServe runs idemctl serve on db's schema on a free loopback port and
// returns its base URL; the process is stopped at the end of the test.
func (b Binary) StartServe(t testing.TB, db *pgtest.DB, env []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, string(b), append([]string{"serve", "--listen", "127.0.0.1:0", "--schema", db.Schema, "--refresh", "1s"}, args...)...)
	cmd.Env = environ(append([]string{"DATABASE_URL=" + db.URL}, env...), "IDEMCTL_TOKEN=")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second): // a hang guard, not a threshold
			cancel()
			<-done
		}
		cancel()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err, "idemctl serve did not start: %s", stderr.String())
	m := regexp.MustCompile(`listening on (http://\S+),`).FindStringSubmatch(line)
	require.NotNil(t, m, line)
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return m[1]
}

// V7At returns a UUIDv7 created at tm, with random bits.
func V7At(tm time.Time) uuid.UUID {
	u := partition.Floor(tm)
	r := uuid.New()
	u[7] = r[7]
	copy(u[9:], r[9:])
	return u
}

// Claim registers group (when register) and claims ids for it.
func Claim(t testing.TB, db *pgtest.DB, group string, register bool, ids ...uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	tc := deduplicator.TableConfig{Schema: db.Schema}
	_, partitioned, err := partition.Partitioned(ctx, db.Pool, ident.Quote(tc.Schema, "processed_event"))
	require.NoError(t, err)
	if partitioned {
		tc.Layout = deduplicator.LayoutPartitioned
	}
	d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: group}, nil)
	require.NoError(t, err)
	if register {
		_, err = d.Register(ctx, db.Pool, "")
		require.NoError(t, err)
	}
	for _, id := range ids {
		first, err := d.Claim(ctx, db.Pool, id)
		require.NoError(t, err)
		require.True(t, first)
	}
}

// ParkKey parks key in group with a first event whose copy on
// orders.retry is overdue, and returns that event.
func ParkKey(t testing.TB, db *pgtest.DB, group, key, reason string) string {
	t.Helper()
	id := publisher.NewEventID().String()
	db.Exec(t, `INSERT INTO retry_parked_key (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata)
VALUES ($1, $2, $3::uuid, 'orders.retry', now() - interval '10 minutes', 'm0', '{}', jsonb_build_object('event_id', $3::text, 'retry_attempt', '2', 'retry_error', $4::text))`, group, key, id, reason)
	return id
}
