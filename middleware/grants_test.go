package middleware_test

// The least-privilege grants of docs/security.md, tested: roles made for the
// test get exactly the SQL blocks of that page (schema and role names
// replaced), and the consumer and the Cleaner run as those roles, connected
// with user=<role>, against the real PostgreSQL.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// The role names docs/security.md uses; the test replaces each with a name
// of its own (roles are cluster-wide, and tests run in parallel).
var securityDocRoles = []string{"idem_migrator", "billing_consumer", "idem_cleaner", "idem_relay"}

var grantsMarker = regexp.MustCompile("(?s)<!-- grants:([a-z-]+) -->\\s*```sql\\n(.*?)```")

// securityGrants returns the SQL blocks of docs/security.md by name.
func securityGrants(t *testing.T) map[string]string {
	t.Helper()
	doc, err := os.ReadFile("../docs/security.md")
	require.NoError(t, err)
	blocks := map[string]string{}
	for _, m := range grantsMarker.FindAllStringSubmatch(string(doc), -1) {
		blocks[m[1]] = m[2]
	}
	for _, name := range []string{"migrator", "consumer", "outbox-writer", "cleaner", "cleaner-partitioned"} {
		require.Contains(t, blocks, name, "docs/security.md has the block <!-- grants:%s -->", name)
	}
	return blocks
}

// grantsEnv is a test schema and the test's own roles.
type grantsEnv struct {
	db     *pgtest.DB
	blocks map[string]string
	roles  map[string]string // doc name -> the test's role
}

func newGrantsEnv(t *testing.T) *grantsEnv {
	t.Helper()
	e := &grantsEnv{db: pgtest.New(t, 4), blocks: securityGrants(t), roles: map[string]string{}}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	for _, r := range securityDocRoles {
		e.roles[r] = "t_" + r + "_" + hex.EncodeToString(rnd[:])
	}
	// Registered before any pool of a role, so it runs after they are
	// closed (cleanups run last-in first-out), and before the schema goes.
	t.Cleanup(func() {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, pgtest.URL())
		if err != nil {
			t.Errorf("grants: cleanup connect: %v", err)
			return
		}
		defer conn.Close(ctx)
		for _, r := range e.roles {
			var exists bool
			if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)", r).Scan(&exists); err != nil || !exists {
				continue
			}
			q := pgx.Identifier{r}.Sanitize()
			if _, err := conn.Exec(ctx, "DROP OWNED BY "+q+" CASCADE; DROP ROLE "+q); err != nil {
				t.Errorf("grants: drop role %s: %v", r, err)
			}
		}
	})
	return e
}

// apply runs the named block of docs/security.md, with the test's schema
// and roles, as the superuser of the test database.
func (e *grantsEnv) apply(t *testing.T, name string) {
	t.Helper()
	sql := regexp.MustCompile(`\bpublic\b`).ReplaceAllString(e.blocks[name], e.db.Schema)
	for doc, r := range e.roles {
		sql = regexp.MustCompile(`\b`+doc+`\b`).ReplaceAllString(sql, r)
	}
	e.db.Exec(t, sql)
}

// pool connects as the test's role for the doc's role name.
func (e *grantsEnv) pool(t *testing.T, docRole string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.ConnConfig.User = e.roles[docRole]
	cfg.ConnConfig.RuntimeParams["search_path"] = e.db.Schema
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var user string
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT current_user").Scan(&user))
	require.Equal(t, e.roles[docRole], user)
	return pool
}

func requireDenied(t *testing.T, err error, what string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%s: want a permission error, got %v", what, err)
	require.Equal(t, pgerrcode.InsufficientPrivilege, pgErr.Code, what)
}

// The consumer (dedup middleware in single and in group-commit mode, with
// its outbox writer) and the Cleaner (plain layout) run with exactly the
// grants docs/security.md lists, each as its own role; the migrations run
// as the migrator role, which owns the tables. The consumer cannot delete
// a claim; the Cleaner cannot claim.
func TestGrantsConsumerAndCleanerPlain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newGrantsEnv(t)
	table := deduplicator.TableConfig{Schema: e.db.Schema}

	e.apply(t, "migrator")
	migrator := e.pool(t, "idem_migrator", 1)
	require.NoError(t, migrate.Up(ctx, migrator, deduplicator.MigrationLine(table)))
	ob, err := outbox.New(outbox.Config{Schema: e.db.Schema, Topics: []string{"invoices"}}, nil)
	require.NoError(t, err)
	require.NoError(t, migrate.Up(ctx, migrator, outbox.MigrationLine(ob.Config(), "invoices")))
	e.apply(t, "consumer")
	e.apply(t, "outbox-writer")
	e.apply(t, "cleaner")
	// The business table is the application's: its grant is not the library's.
	e.db.Exec(t, "CREATE TABLE ledger (event_id uuid NOT NULL, consumer_group text NOT NULL, amount bigint NOT NULL)")
	e.db.Exec(t, "GRANT INSERT ON ledger TO "+e.roles["billing_consumer"])

	consumer := e.pool(t, "billing_consumer", 4)
	require.NoError(t, ob.Check(ctx, consumer))
	var calls atomic.Int32
	handler := func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, idem.Complete(m.Context(), func(ctx context.Context, tx pgx.Tx) error {
			id, _ := idem.EventIDFromContext(ctx)
			if _, err := tx.Exec(ctx, "INSERT INTO ledger (event_id, consumer_group, amount) VALUES ($1, 'billing', 1)", id); err != nil {
				return err
			}
			pub, err := ob.PublisherFromContext(ctx)
			if err != nil {
				return err
			}
			return pub.Publish("invoices", message.NewMessage(uuid.NewString(), []byte(`{"invoice":1}`)))
		})
	}
	msg := func(id uuid.UUID) *message.Message {
		m := message.NewMessage(uuid.NewString(), []byte(`{"amount":1}`))
		m.Metadata.Set(publisher.MetadataEventID, id.String())
		return m
	}

	// Single mode: start-up (check, retention, registration), claims, a
	// duplicate.
	single, err := idem.NewDedup(idem.Config{DB: consumer, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)
	h := single.Middleware(handler)
	ids := newIDs(3)
	for _, id := range ids {
		_, err := h(msg(id))
		require.NoError(t, err)
	}
	_, err = h(msg(ids[0]))
	require.NoError(t, err)
	require.EqualValues(t, 3, calls.Load(), "the redelivery is a duplicate")

	// Group commit: the multi-row claim with RETURNING.
	grouped, err := idem.NewDedup(idem.Config{DB: consumer, ConsumerGroup: "billing", Table: table,
		Mode: &idem.GroupCommitConfig{MaxMessages: 8, MaxWait: 100 * time.Millisecond, Concurrency: 2}}, nil)
	require.NoError(t, err)
	gids := newIDs(8)
	msgs := make([]*message.Message, len(gids))
	for i, id := range gids {
		msgs[i] = msg(id)
	}
	for i, err := range deliverAll(grouped.Middleware(handler), msgs) {
		require.NoError(t, err, "delivery %d", i)
	}
	require.Positive(t, grouped.Stats().Groups)
	require.EqualValues(t, 11, calls.Load())
	require.Equal(t, 11, e.db.Count(t, "SELECT 1 FROM ledger"))
	require.Equal(t, 11, e.db.Count(t, "SELECT 1 FROM outbox_invoices"))

	// Lease mode: take, renew-free call, completion, a handler error's
	// release, a duplicate.
	leased, err := idem.NewDedup(idem.Config{DB: consumer, ConsumerGroup: "billing", Table: table, Mode: &idem.LeaseConfig{Concurrency: 1}}, nil)
	require.NoError(t, err)
	lh := leased.Middleware(handler)
	_, err = leased.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("provider down") })(msg(gids[0]))
	require.NoError(t, err, "a duplicate: the handler does not run")
	lids := newIDs(3)
	_, err = leased.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("provider down") })(msg(lids[0]))
	require.ErrorContains(t, err, "provider down", "the lease is released")
	for _, id := range lids {
		_, err := lh(msg(id))
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, leased.Stats().LeasesTaken-1)
	require.EqualValues(t, 14, calls.Load())
	require.Equal(t, 14, e.db.Count(t, "SELECT 1 FROM ledger"))
	require.Equal(t, 14, e.db.Count(t, "SELECT 1 FROM outbox_invoices"))

	// Least privilege is real: the consumer cannot forget a claim or change
	// the retention.
	_, err = consumer.Exec(ctx, "DELETE FROM processed_event")
	requireDenied(t, err, "consumer deletes claims")
	_, err = consumer.Exec(ctx, "UPDATE processed_event_setting SET retention = interval '1 day'")
	requireDenied(t, err, "consumer changes the retention")

	// The Cleaner deletes the old claims of a group registered long ago and
	// keeps the young group's and the recent ones.
	old := time.Now().Add(-10 * 24 * time.Hour)
	oldIDs := make([]uuid.UUID, 5)
	for i := range oldIDs {
		oldIDs[i] = v7Created(old)
	}
	e.db.Exec(t, "INSERT INTO processed_event_group (consumer_group, first_seen_at, idempotency_namespace) VALUES ('archive', '-infinity', 'archive')")
	e.db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group, processed_at) SELECT id, 'archive', $2 FROM unnest($1::uuid[]) id", oldIDs, old)
	cleanerPool := e.pool(t, "idem_cleaner", 2)
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: cleanerPool}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Deleted)
	require.Zero(t, e.db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = 'archive'"))
	require.Equal(t, 14, e.db.Count(t, "SELECT 1 FROM processed_event WHERE consumer_group = 'billing'"))

	_, err = cleanerPool.Exec(ctx, "INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing')", publisher.NewEventID())
	requireDenied(t, err, "cleaner claims")
}

// The partitioned layout's Cleaner, as a member of the owner role (the
// block cleaner-partitioned): it creates partitions ahead and drops a
// partition wholly older than the retention.
func TestGrantsCleanerPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newGrantsEnv(t)
	table := deduplicator.TableConfig{Schema: e.db.Schema, Layout: deduplicator.LayoutPartitioned}

	e.apply(t, "migrator")
	migrator := e.pool(t, "idem_migrator", 1)
	require.NoError(t, migrate.Up(ctx, migrator, deduplicator.MigrationLine(table)))
	e.apply(t, "cleaner")
	e.apply(t, "cleaner-partitioned")

	// A partition ten days old, made by an earlier pass (as the owner), with
	// claims of a group registered long ago.
	day := time.Now().UTC().AddDate(0, 0, -10)
	from, to := partition.Bounds(day)
	oldPart := partition.Name("processed_event", day)
	_, err := migrator.Exec(ctx, "CREATE TABLE "+oldPart+" PARTITION OF processed_event FOR VALUES FROM ('"+from.String()+"') TO ('"+to.String()+"')")
	require.NoError(t, err)
	e.db.Exec(t, "INSERT INTO processed_event_group (consumer_group, first_seen_at, idempotency_namespace) VALUES ('archive', '-infinity', 'archive')")
	e.db.Exec(t, "INSERT INTO processed_event (event_id, consumer_group, processed_at) VALUES ($1, 'archive', $2)", v7Created(day.Add(time.Hour)), day)

	cleanerPool := e.pool(t, "idem_cleaner", 2)
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: table, DB: cleanerPool,
		PartitionsAhead: 3 + 2 /* two more than the default, 3 */}, nil)
	require.NoError(t, err)
	res, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Len(t, res.PartitionsCreated, 2, "two more days ahead")
	require.Len(t, res.PartitionsDropped, 1)
	require.Zero(t, e.db.Count(t, "SELECT 1 FROM pg_class WHERE relname = $1 AND relnamespace = $2::regnamespace", oldPart, e.db.Schema))
}

// v7Created returns a random UUIDv7 created at t.
func v7Created(t time.Time) uuid.UUID {
	u := uuid.Must(uuid.NewV7())
	ms := uint64(t.UnixMilli())
	for i := 0; i < 6; i++ {
		u[i] = byte(ms >> (40 - 8*i))
	}
	return u
}
