package ops_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

// ForgetGroup refuses a group that is not registered (bad input, nothing
// deleted) and deletes a registered group's claims and registration only;
// ReleaseLease refuses a malformed id; ResolveTable reads the layout.
func TestForgetGroupAndReleaseLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: db.Schema})))
	ctltest.Claim(t, db, "billing", true, publisher.NewEventID(), publisher.NewEventID())
	ctltest.Claim(t, db, "shipping", true, publisher.NewEventID())

	tc, err := ops.ResolveTable(ctx, db.Pool, db.Schema, "processed_event", "auto", false)
	require.NoError(t, err)
	require.Equal(t, deduplicator.LayoutPlain, tc.Layout)
	_, err = ops.ResolveTable(ctx, db.Pool, db.Schema, "processed_event", "sideways", false)
	require.True(t, ops.IsBadInput(err), "%v", err)

	_, err = ops.ForgetGroup(ctx, db.Pool, tc, "nobody")
	require.True(t, ops.IsBadInput(err), "%v", err)
	require.ErrorContains(t, err, `unknown consumer group "nobody"`)
	require.Equal(t, 3, db.Count(t, `SELECT 1 FROM processed_event`))

	n, err := ops.ForgetGroup(ctx, db.Pool, tc, "billing")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.Equal(t, "forgot billing: 2 claims deleted, registration removed", ops.ForgotGroup("billing", n))
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = 'shipping'`))
	require.True(t, ops.IsBadInput(ops.Registered(ctx, db.Pool, tc, "billing")))
	require.NoError(t, ops.Registered(ctx, db.Pool, tc, "shipping"))

	_, _, err = ops.ReleaseLease(ctx, db.Pool, tc, "not-a-uuid", "shipping")
	require.True(t, ops.IsBadInput(err), "%v", err)
}
