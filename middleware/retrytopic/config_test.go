package retrytopic_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Invalid configs are refused with the field's name; the zero Backoff and
// MaxAttempts are valid (defaults).
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	var pub message.Publisher = gochannel.NewGoChannel(gochannel.Config{}, nil)
	ok := func() retrytopic.Config {
		return retrytopic.Config{Publisher: pub, Topics: []string{"orders-retry"}, PoisonTopic: "orders-poison"}
	}
	require.NoError(t, ok().Validate())
	for name, tc := range map[string]struct {
		mod  func(*retrytopic.Config)
		want string
	}{
		"no publisher":       {func(c *retrytopic.Config) { c.Publisher = nil }, "Publisher: required"},
		"no topics":          {func(c *retrytopic.Config) { c.Topics = nil }, "Topics: at least one"},
		"empty topic":        {func(c *retrytopic.Config) { c.Topics = []string{"a", ""} }, "Topics[1]: must not be empty"},
		"poison is retry":    {func(c *retrytopic.Config) { c.Topics = []string{"orders-poison"} }, "Topics[0]: \"orders-poison\" is also the PoisonTopic"},
		"no poison":          {func(c *retrytopic.Config) { c.PoisonTopic = "" }, "PoisonTopic: required"},
		"negative attempts":  {func(c *retrytopic.Config) { c.MaxAttempts = -1 }, "MaxAttempts: -1 must be at least 1"},
		"multiplier below 1": {func(c *retrytopic.Config) { c.Backoff.Multiplier = 0.5 }, "Backoff.Multiplier"},
		"max below initial":  {func(c *retrytopic.Config) { c.Backoff.Initial = 10e9; c.Backoff.Max = 1e9 }, "Backoff.Max"},
		"jitter above 1":     {func(c *retrytopic.Config) { c.Backoff.Jitter = 1.5 }, "Backoff.Jitter"},
		"order without db":   {func(c *retrytopic.Config) { c.KeyOrder = &retrytopic.KeyOrder{ConsumerGroup: "g"} }, "KeyOrder.DB: required"},
		"order without outbox": {func(c *retrytopic.Config) {
			c.KeyOrder = &retrytopic.KeyOrder{DB: pgtestDummy{}, ConsumerGroup: "g"}
		}, "KeyOrder.Outbox: required"},
		"order without group": {func(c *retrytopic.Config) {
			c.KeyOrder = &retrytopic.KeyOrder{DB: pgtestDummy{}, Outbox: outboxDummy{}}
		}, "KeyOrder.ConsumerGroup: required"},
		"order bad table": {func(c *retrytopic.Config) {
			c.KeyOrder = &retrytopic.KeyOrder{DB: pgtestDummy{}, Outbox: outboxDummy{}, ConsumerGroup: "g", Table: retrytopic.ParkedKeysTable{Table: "x; DROP"}}
		}, "KeyOrder.Table.Table:"},
	} {
		cfg := ok()
		tc.mod(&cfg)
		err := cfg.Validate()
		require.ErrorContains(t, err, tc.want, name)
		_, err = retrytopic.New(cfg, nil)
		require.ErrorContains(t, err, "retrytopic: invalid config: "+tc.want, name)
	}
}

// New refuses KeyOrder on a schema whose parked-keys table is not migrated.
func TestNewRefusesUnmigratedParkedKeysTable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	cfg := retrytopic.Config{Publisher: pub, Topics: []string{"r"}, PoisonTopic: "p",
		KeyOrder: &retrytopic.KeyOrder{DB: db.Pool, Outbox: outboxDummy{}, ConsumerGroup: "g", Table: retrytopic.ParkedKeysTable{Schema: db.Schema}}}
	_, err := retrytopic.New(cfg, nil)
	require.ErrorIs(t, err, migrate.ErrMigrationsPending)

	tbl := retrytopic.ParkedKeysTable{Schema: db.Schema}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, retrytopic.MigrationLine(tbl)))
	require.NoError(t, migrate.Up(context.Background(), db.Pool, retrytopic.MigrationLine(tbl)), "Migrate is idempotent")
	_, err = retrytopic.New(cfg, nil)
	require.NoError(t, err)
}

// The rendered migrations create the same table for goose/golang-migrate,
// recorded so that New accepts it, and Down removes it.
func TestMigrationsSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	render, err := migrate.New(nil, retrytopic.MigrationLine(retrytopic.ParkedKeysTable{Schema: db.Schema, Table: "parked"}))
	require.NoError(t, err)
	migs, err := render.Migrations()
	require.NoError(t, err)
	require.Len(t, migs, 2)
	require.Equal(t, 1, migs[0].Version)
	require.Equal(t, "parked_key", migs[0].Name)
	require.Equal(t, 2, migs[1].Version)
	require.Equal(t, "parked_message", migs[1].Name)
	db.Exec(t, migs[0].Up)
	db.Exec(t, migs[1].Up)
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	_, err = retrytopic.New(retrytopic.Config{Publisher: pub, Topics: []string{"r"}, PoisonTopic: "p",
		KeyOrder: &retrytopic.KeyOrder{DB: db.Pool, Outbox: outboxDummy{}, ConsumerGroup: "g", Table: retrytopic.ParkedKeysTable{Schema: db.Schema, Table: "parked"}}}, nil)
	require.NoError(t, err)
	parked, err := retrytopic.ListParked(ctx, db.Pool, retrytopic.ParkedKeysTable{Schema: db.Schema, Table: "parked"}, "")
	require.NoError(t, err)
	require.Empty(t, parked)
	db.Exec(t, migs[1].Down)
	db.Exec(t, migs[0].Down)
	require.Zero(t, db.Count(t, "SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = 'parked'", db.Schema))
}

// pgtestDummy is a Beginner for validation tests; it is never called.
type pgtestDummy struct{}

func (pgtestDummy) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("not a database") }

// outboxDummy is an OutboxWriter for tests that never hand a key on.
type outboxDummy struct{}

func (outboxDummy) PublishInTx(context.Context, pgx.Tx, string, ...*message.Message) error {
	return errors.New("not an outbox")
}
