package main_test

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

// bin is the idemctl binary built once for every test, with buildFlags.
var (
	bin        ctltest.Binary
	buildFlags []string
)

func TestMain(m *testing.M) { os.Exit(ctltest.Main(m, &bin, ".", buildFlags...)) }

// result is one run of the binary.
type result = ctltest.Result

// run execs idemctl with args and env (KEY=value) on top of an environment
// without DATABASE_URL and KAFKA_BROKERS.
func run(t *testing.T, env []string, args ...string) result {
	t.Helper()
	return bin.Run(t, env, args...)
}

// ctl runs idemctl on db's schema (DATABASE_URL in the environment).
func ctl(t *testing.T, db *pgtest.DB, args ...string) result {
	t.Helper()
	return bin.Ctl(t, db, args...)
}

// ok runs ctl and requires exit 0.
func ok(t *testing.T, db *pgtest.DB, args ...string) result {
	t.Helper()
	return bin.OK(t, db, args...)
}

// fails runs ctl and requires the exit code and a message on stderr.
func fails(t *testing.T, db *pgtest.DB, code int, wantErr string, args ...string) result {
	t.Helper()
	r := ctl(t, db, args...)
	require.Equal(t, code, r.Code, "idemctl %s\n%s", strings.Join(args, " "), r)
	require.Contains(t, r.Stderr, wantErr, "idemctl %s\n%s", strings.Join(args, " "), r)
	return r
}

// decode unmarshals a --json output.
func decode[T any](t *testing.T, r result) T {
	t.Helper()
	var v T
	require.NoError(t, json.Unmarshal([]byte(r.Stdout), &v), "not JSON:\n%s", r)
	return v
}

// v7At returns a UUIDv7 created at tm, with random bits.
func v7At(tm time.Time) uuid.UUID { return ctltest.V7At(tm) }

// migrated returns a test schema with the dedup table (in layout) and the
// outbox tables of topics migrated by idemctl itself.
func migrated(t *testing.T, layout string, topics ...string) *pgtest.DB {
	t.Helper()
	return bin.Migrated(t, layout, topics...)
}

// claim registers group (when register) and claims ids for it.
func claim(t *testing.T, db *pgtest.DB, group string, register bool, ids ...uuid.UUID) {
	t.Helper()
	ctltest.Claim(t, db, group, register, ids...)
}
