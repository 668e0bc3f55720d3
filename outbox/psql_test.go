package outbox_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// psqlFile runs one SQL file with the psql binary, as a goose or
// golang-migrate user's pipeline would, with search_path set to schema.
func psqlFile(t *testing.T, schema, file string) {
	t.Helper()
	cmd := exec.Command("psql", pgtest.URL(), "-v", "ON_ERROR_STOP=1", "-q", "-f", file)
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+schema)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "psql -f %s: %s", file, out)
}

// writeSQL writes body to dir/name and returns its path.
func writeSQL(t *testing.T, dir, name, body string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(path, []byte(body), 0o600))
	return path
}

// The SQL exported for goose and golang-migrate (a migrate.Migrator's
// Migrations of the dedup and outbox lines), applied by plain psql, makes the same tables and
// records as the Go migrators: they find nothing pending and nothing to
// apply, Check passes, and the forwarder and a watermill-sql subscriber work
// on the outbox tables. The Down SQL takes it all back.
//
// Not parallel: the watermill-sql subscriber keeps a transaction open while
// a message waits for its ack, which holds back every xmin-based reader on
// the server (see TestPubSub).
func TestMigrationsAppliedWithPsql(t *testing.T) {
	if _, err := exec.LookPath("psql"); err != nil {
		t.Skip("psql not installed: ", err)
	}
	ctx := context.Background()
	db := pgtest.New(t, 8)
	e := &env{db: db}
	topic := e.kafka(t).Topic(t, "psql", 2)
	table := deduplicator.TableConfig{Schema: db.Schema}
	cfg := outbox.Config{Schema: db.Schema, Topics: []string{topic}}
	ob, err := outbox.New(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	e.outbox = ob

	dedupMigs, err := rendered(deduplicator.MigrationLine(table))
	require.NoError(t, err)
	outboxMigs, err := rendered(lines(cfg)...)
	require.NoError(t, err)
	require.Len(t, outboxMigs, 5)
	require.Equal(t, "outbox:outbox_"+topic, outboxMigs[0].Component)

	// One file per version, numbered for the tool, as docs/operations.md
	// names them.
	dir := t.TempDir()
	safe := strings.NewReplacer(":", "_", ".", "_", "-", "_", "$", "_")
	var ups, downs []string
	for i, m := range append(dedupMigs, outboxMigs...) {
		name := fmt.Sprintf("%05d_%s_%s", i+1, safe.Replace(m.Component), m.Name)
		ups = append(ups, writeSQL(t, dir, name+".up.sql", m.Up))
		downs = append([]string{writeSQL(t, dir, name+".down.sql", m.Down)}, downs...)
	}
	for _, f := range ups {
		psqlFile(t, db.Schema, f)
	}

	dm, err := migrate.New(db.Pool, deduplicator.MigrationLine(table))
	require.NoError(t, err)
	dv, err := dm.Validate(ctx)
	require.NoError(t, err)
	require.True(t, dv.OK, "pending: %+v", dv.Pending)
	om, err := newMigrator(db.Pool, cfg)
	require.NoError(t, err)
	require.Empty(t, pendingOf(t, om))
	require.NoError(t, deduplicator.Check(ctx, db.Pool, table))
	require.NoError(t, ob.Check(ctx, db.Pool))
	dres, err := dm.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, dres.Versions)
	ores, err := om.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Empty(t, ores.Versions)

	// The forwarder delivers rows written to the psql-made tables.
	f := e.startForwarder(t, outbox.ForwarderConfig{Topics: []string{topic}})
	e.publishTx(t, topic, event("a", 0), event("a", 1), event("b", 0), event("b", 1))
	recs := consume(t, e.kafka(t).Addrs, topic, 4)
	require.Len(t, recs, 4)
	requirePerKeyOrder(t, recs, 2)

	// So does a watermill-sql subscriber, in its own consumer group.
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(db.Pool), wsql.SubscriberConfig{
		ConsumerGroup:  "psql-subscriber",
		SchemaAdapter:  schemaAdapter(ob),
		OffsetsAdapter: offsetsAdapter(ob),
		PollInterval:   10 * time.Millisecond,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	subCtx, cancel := context.WithTimeout(ctx, eventuallyTimeout)
	defer cancel()
	msgs, err := sub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	got := map[string]bool{}
	for len(got) < 4 {
		select {
		case msg := <-msgs:
			got[string(msg.Payload)] = true
			msg.Ack()
		case <-subCtx.Done():
			require.FailNow(t, "watermill-sql subscriber", "got %d of 4 messages", len(got))
		}
	}
	require.NoError(t, sub.Close())
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM "+outbox.OffsetsTable(ob, topic)+" WHERE consumer_group = 'psql-subscriber' AND offset_acked > 0"))
	require.NoError(t, f.Close()) // before its tables are dropped

	for _, f := range downs {
		psqlFile(t, db.Schema, f)
	}
	dv, err = dm.Validate(ctx)
	require.NoError(t, err)
	require.Len(t, dv.Pending, len(dedupMigs))
	require.Len(t, pendingOf(t, om), len(outboxMigs))
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "only idem_schema_migration is left")
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
}
