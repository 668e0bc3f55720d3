package auditsql_test

import (
	"context"
	"errors"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/auditsql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func migrated(t *testing.T) *pgtest.DB {
	t.Helper()
	db := pgtest.New(t, 2)
	line := migrate.Line{Component: auditsql.Component, Schema: db.Schema, Templates: []fs.FS{auditsql.Migrations},
		Data: struct{ Schema string }{db.Schema}}
	require.NoError(t, migrate.Up(context.Background(), db.Pool, line))
	return db
}

// An action is appended with its messages on the database's clock, listed
// newest first, and gives the records it handled their disposition; a
// refused action gives none.
func TestAppendListDispositions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t)

	id1, at1, err := auditsql.Append(ctx, db.Pool, db.Schema, auditsql.Entry{Actor: "alice", Action: auditsql.ActionReplay,
		Topic: "orders.poison", Filter: []byte(`{"reason":"timeout"}`), Result: auditsql.ResultOK, Detail: "2 replayed",
		Messages: []auditsql.Message{{Partition: 0, Offset: 7, EventID: "e7"}, {Partition: 1, Offset: 3, EventID: "e3"}}})
	require.NoError(t, err)
	require.False(t, at1.IsZero())
	id2, _, err := auditsql.Append(ctx, db.Pool, db.Schema, auditsql.Entry{Actor: "bob", Action: auditsql.ActionEditReplay,
		Topic: "orders.poison", Result: auditsql.ResultRefused, Detail: "invalid payload",
		Messages: []auditsql.Message{{Partition: 0, Offset: 8, EventID: "e8", Original: []byte(`{"a":1}`)}}})
	require.NoError(t, err)
	id3, _, err := auditsql.Append(ctx, db.Pool, db.Schema, auditsql.Entry{Actor: "carol", Action: auditsql.ActionDiscard,
		Topic: "orders.poison", Result: auditsql.ResultOK, Messages: []auditsql.Message{{Partition: 1, Offset: 3, EventID: "e3"}}})
	require.NoError(t, err)
	require.Less(t, id1, id2)

	list, err := auditsql.List(ctx, db.Pool, db.Schema, 0, 10)
	require.NoError(t, err)
	require.Len(t, list, 3)
	require.Equal(t, []int64{id3, id2, id1}, []int64{list[0].ID, list[1].ID, list[2].ID})
	require.Equal(t, "alice", list[2].Actor)
	require.JSONEq(t, `{"reason":"timeout"}`, string(list[2].Filter))
	require.Equal(t, 2, list[2].MessageCount)
	require.Equal(t, []auditsql.Message{{Partition: 0, Offset: 7, EventID: "e7"}, {Partition: 1, Offset: 3, EventID: "e3"}}, list[2].Messages)
	older, err := auditsql.List(ctx, db.Pool, db.Schema, id2, 10)
	require.NoError(t, err)
	require.Len(t, older, 1)
	require.Equal(t, id1, older[0].ID)

	disp, err := auditsql.Dispositions(ctx, db.Pool, db.Schema, "orders.poison",
		[]auditsql.Location{{0, 7}, {0, 8}, {1, 3}, {2, 0}})
	require.NoError(t, err)
	require.Len(t, disp, 2, "the refused edit handled nothing")
	require.Equal(t, auditsql.ActionReplay, disp[auditsql.Location{0, 7}].Action)
	require.Equal(t, auditsql.ActionDiscard, disp[auditsql.Location{1, 3}].Action, "the latest action wins")
	require.Equal(t, "carol", disp[auditsql.Location{1, 3}].Actor)
	other, err := auditsql.Dispositions(ctx, db.Pool, db.Schema, "payments.poison", []auditsql.Location{{0, 7}})
	require.NoError(t, err)
	require.Empty(t, other)

	var original []byte
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT original_payload FROM idem_audit_message WHERE audit_id = $1`, id2).Scan(&original))
	require.Equal(t, `{"a":1}`, string(original))
}

// The trail cannot be changed: UPDATE, DELETE and TRUNCATE of either table
// are refused with SQLSTATE 23001, whoever runs them.
func TestAppendOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := migrated(t)
	_, _, err := auditsql.Append(ctx, db.Pool, db.Schema, auditsql.Entry{Actor: "alice", Action: auditsql.ActionDiscard,
		Topic: "t", Result: auditsql.ResultOK, Messages: []auditsql.Message{{Partition: 0, Offset: 1}}})
	require.NoError(t, err)
	for _, stmt := range []string{
		`UPDATE idem_audit SET actor = 'mallory'`,
		`DELETE FROM idem_audit`,
		`TRUNCATE idem_audit CASCADE`,
		`UPDATE idem_audit_message SET event_id = 'x'`,
		`DELETE FROM idem_audit_message`,
		`TRUNCATE idem_audit_message`,
	} {
		_, err := db.Pool.Exec(ctx, stmt)
		require.Error(t, err, stmt)
		require.True(t, errors.Is(auditsql.Refused(err), auditsql.ErrAppendOnly), "%s: %v", stmt, err)
	}
	list, err := auditsql.List(ctx, db.Pool, db.Schema, 0, 10)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, "alice", list[0].Actor)
	require.Equal(t, 1, list[0].MessageCount)

	// An empty actor is refused by the table itself.
	_, _, err = auditsql.Append(ctx, db.Pool, db.Schema, auditsql.Entry{Action: auditsql.ActionDiscard, Topic: "t", Result: auditsql.ResultOK})
	require.Error(t, err)
	require.False(t, errors.Is(auditsql.Refused(err), auditsql.ErrAppendOnly))
}
