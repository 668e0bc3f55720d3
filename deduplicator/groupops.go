package deduplicator

import (
	"context"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// RenameGroup gives consumer group from's claims and registration to the
// new name to, in one transaction of db: the claims are copied (every event
// from applied stays applied for to), and to takes from's first-seen time
// and Idempotency-Key namespace, so the keys of downstream calls do not
// change. from's claims and registration stay until [ForgetGroup] removes
// them. It returns the new group as recorded and the number of claims
// copied; [ErrGroupNotFound] when from is not registered, [ErrGroupExists]
// when to is registered or holds claims, and an error wrapping
// [ErrInvalidGroupName] for a name PostgreSQL cannot store.
//
// Run it with the consumers of both names stopped, then move the Kafka
// offsets with Kafka's tooling and start the consumers under the new name
// (idemctl groups rename).
func RenameGroup(ctx context.Context, db migrate.Beginner, table TableConfig, from, to string) (renamed Group, claimsCopied int64, err error) {
	table.setDefaults()
	g, n, err := dedupsql.RenameGroup(ctx, db, table.Schema, table.Table, from, to, ValidateGroupName)
	return Group(g), n, err
}

// ForgetGroup deletes a consumer group's claims and registration, in one
// transaction of db, and returns the number of claims deleted
// ([ErrGroupNotFound] for a group not registered). Use it for a group that
// no longer consumes (after [RenameGroup], or a decommissioned service): a
// consumer of that group started afterwards is new, and applies every event
// it reads again (idemctl groups forget).
func ForgetGroup(ctx context.Context, db migrate.Beginner, table TableConfig, group string) (int64, error) {
	table.setDefaults()
	return dedupsql.ForgetGroup(ctx, db, table.Schema, table.Table, group, ValidateGroupName)
}
