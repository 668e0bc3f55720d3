package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

// bin is the idemctl binary built once for every test, with buildFlags.
var (
	bin        string
	buildFlags []string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemctl-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "idemctl")
	goBin, err := exec.LookPath("go")
	if err != nil {
		fmt.Fprintln(os.Stderr, "go not in PATH:", err)
		os.Exit(1)
	}
	build := exec.Command(goBin, append(append([]string{"build"}, buildFlags...), "-o", bin, ".")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build idemctl:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// result is one run of the binary.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// run execs idemctl with args and env (KEY=value) on top of an environment
// without DATABASE_URL and KAFKA_BROKERS.
func run(t *testing.T, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a hang guard, not a threshold
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "KAFKA_BROKERS=") && !strings.HasPrefix(kv, "PG") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return result{stdout.String(), stderr.String(), code}
}

// ctl runs idemctl on db's schema (DATABASE_URL in the environment).
func ctl(t *testing.T, db *pgtest.DB, args ...string) result {
	t.Helper()
	return run(t, []string{"DATABASE_URL=" + db.URL}, append(args, "--schema", db.Schema)...)
}

// ok runs ctl and requires exit 0.
func ok(t *testing.T, db *pgtest.DB, args ...string) result {
	t.Helper()
	r := ctl(t, db, args...)
	require.Equal(t, 0, r.code, "idemctl %s\n%s", strings.Join(args, " "), r)
	return r
}

// fails runs ctl and requires the exit code and a message on stderr.
func fails(t *testing.T, db *pgtest.DB, code int, wantErr string, args ...string) result {
	t.Helper()
	r := ctl(t, db, args...)
	require.Equal(t, code, r.code, "idemctl %s\n%s", strings.Join(args, " "), r)
	require.Contains(t, r.stderr, wantErr, "idemctl %s\n%s", strings.Join(args, " "), r)
	return r
}

// decode unmarshals a --json output.
func decode[T any](t *testing.T, r result) T {
	t.Helper()
	var v T
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), "not JSON:\n%s", r)
	return v
}

// v7At returns a UUIDv7 created at tm, with random bits.
func v7At(tm time.Time) uuid.UUID {
	u := partition.Floor(tm)
	r := uuid.New()
	u[7] = r[7]
	copy(u[9:], r[9:])
	return u
}

// migrated returns a test schema with the dedup table (in layout) and the
// outbox tables of topics migrated by idemctl itself.
func migrated(t *testing.T, layout string, topics ...string) *pgtest.DB {
	t.Helper()
	db := pgtest.New(t, 4)
	args := []string{"migrate", "up", "--layout", layout}
	if len(topics) > 0 {
		args = append(args, "--topics", strings.Join(topics, ","))
	}
	ok(t, db, args...)
	return db
}

// claim registers group (when register) and claims ids for it.
func claim(t *testing.T, db *pgtest.DB, group string, register bool, ids ...uuid.UUID) {
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
