package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// DB is what an operation that writes in a transaction of its own takes:
// a pool, a connection or a transaction (a savepoint).
type DB interface {
	dbx.Querier
	dbx.Beginner
}

// ResolveTable returns the processed_event table schema.table; with layout
// "auto" (or "") its layout is read from the database (plain when the
// table does not exist yet and missingOK).
func ResolveTable(ctx context.Context, db dbx.Querier, schema, table, layout string, missingOK bool) (deduplicator.TableConfig, error) {
	tc := deduplicator.TableConfig{Schema: schema, Table: table}
	if err := tc.Validate(); err != nil {
		return tc, Input("--schema/--table: %v", err)
	}
	switch layout {
	case "plain":
		tc.Layout = deduplicator.LayoutPlain
	case "partitioned":
		tc.Layout = deduplicator.LayoutPartitioned
	case "auto", "":
		exists, partitioned, err := partition.Partitioned(ctx, db, ident.Quote(tc.Schema, tc.Table))
		switch {
		case err != nil:
			return tc, fmt.Errorf("layout of %s.%s: %w", tc.Schema, tc.Table, err)
		case !exists && missingOK:
			tc.Layout = deduplicator.LayoutPlain
		case !exists:
			return tc, fmt.Errorf("table %s.%s does not exist (run idemctl migrate up, or check --schema/--table)", tc.Schema, tc.Table)
		case partitioned:
			tc.Layout = deduplicator.LayoutPartitioned
		default:
			tc.Layout = deduplicator.LayoutPlain
		}
	default:
		return tc, Input("--layout %q: want auto, plain or partitioned", layout)
	}
	if err := tc.Validate(); err != nil {
		return tc, Input("%v", err)
	}
	return tc, nil
}

// RecordedRetention returns the retention recorded with the table.
func RecordedRetention(ctx context.Context, db dbx.Querier, tc deduplicator.TableConfig) (time.Duration, error) {
	s, err := dedupsql.ReadSetting(ctx, db, tc.Schema, tc.Table)
	if err != nil {
		return 0, fmt.Errorf("read retention of %s.%s: %w", tc.Schema, tc.Table, err)
	}
	return s.Retention, nil
}

// RecordedTopics returns the topics migrated in cfg's schema with its
// table prefix (outboxsql.RecordedTopics), after cfg's defaults.
func RecordedTopics(ctx context.Context, db dbx.Querier, cfg outbox.Config) ([]string, error) {
	ob, err := outbox.New(cfg, nil)
	if err != nil {
		return nil, err
	}
	c := ob.Config()
	topics, err := outboxsql.RecordedTopics(ctx, db, c.Schema, c.TablePrefix)
	if err != nil {
		return nil, fmt.Errorf("outbox: recorded topics: %w", err)
	}
	return topics, nil
}

// Registered returns an *InputError unless group is registered with tc.
func Registered(ctx context.Context, db dbx.Querier, tc deduplicator.TableConfig, group string) error {
	gs, err := dedupsql.Groups(ctx, db, tc.Schema, tc.Table)
	if err != nil {
		return err
	}
	for _, g := range gs {
		if g.Name == group {
			return nil
		}
	}
	return Input("unknown consumer group %q: not registered with %s.%s", group, tc.Schema, tc.Table)
}

// ForgetGroup deletes every claim and the registration of a registered
// group, and returns how many claims it deleted. A group that is not
// registered is an *InputError.
func ForgetGroup(ctx context.Context, db DB, tc deduplicator.TableConfig, group string) (int64, error) {
	if err := Registered(ctx, db, tc, group); err != nil {
		return 0, err
	}
	return deduplicator.ForgetGroup(ctx, db, tc, group)
}

// ForgotGroup words what ForgetGroup did.
func ForgotGroup(group string, claims int64) string {
	return fmt.Sprintf("forgot %s: %d claims deleted, registration removed", group, claims)
}

// ReleaseLease deletes the lease of event id for group, whoever holds it,
// and reports whether there was one. A malformed id is an *InputError.
func ReleaseLease(ctx context.Context, db dbx.Querier, tc deduplicator.TableConfig, eventID, group string) (uuid.UUID, bool, error) {
	id, err := uuid.Parse(eventID)
	if err != nil {
		return id, false, Input("invalid event id %q: %v", eventID, err)
	}
	ok, err := leasesql.ForceRelease(ctx, db, tc.Schema, tc.Table, id, group)
	return id, ok, err
}

// NoLease words a ReleaseLease that found no lease.
func NoLease(id uuid.UUID, group string) string {
	return fmt.Sprintf("no lease of %s for %s (completed, released, or never taken)", id, group)
}

// ReadParked reads the parked keys of t (of group only, unless ""): the
// summary per group and at most limit keys (0: all), the longest queues
// first (idemctl retry parked, the console's parked page).
func ReadParked(ctx context.Context, db dbx.Querier, t retrytopic.ParkedKeysTable, group string, limit int) ([]parkedsql.Summary, []parkedsql.Key, error) {
	sum, err := parkedsql.Summarize(ctx, db, t.Schema, t.Table, group, deduplicator.ValidateGroupName)
	if err != nil {
		return nil, nil, err
	}
	keys, err := parkedsql.Keys(ctx, db, t.Schema, t.Table, group, limit, deduplicator.ValidateGroupName)
	if err != nil {
		return nil, nil, err
	}
	return sum, keys, nil
}

// Unblocked words what retrytopic.Unblock did.
func Unblocked(res *retrytopic.UnblockResult) string {
	switch {
	case res.Resent:
		return fmt.Sprintf("event %s sent to %s again through the outbox (due now)", res.Head, res.Topic)
	case res.HandedOff != nil:
		return fmt.Sprintf("event %s removed (neither applied nor poisoned: replay it); the key is handed to event %s on %s", res.Head, *res.HandedOff, res.Topic)
	default:
		return fmt.Sprintf("event %s removed (neither applied nor poisoned: replay it); nothing else waits: the key is free", res.Head)
	}
}
