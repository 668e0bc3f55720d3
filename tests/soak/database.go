package soak

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

func (h *harness) pool(ctx context.Context, component string, maxConns int32) (*pgxpool.Pool, error) {
	return pgPool(ctx, h.cfg.DatabaseURL, h.dbName, h.schema, h.appName(component), maxConns)
}

// appName is the application_name of a component's connections, which the
// pg_terminate_backend fault targets.
func (h *harness) appName(component string) string { return "soak-" + h.runID + "-" + component }

func (h *harness) setupDB(ctx context.Context) error {
	if err := h.createDatabase(ctx); err != nil {
		return err
	}
	if err := h.migrateLibraryTables(ctx); err != nil {
		return err
	}
	if _, err := h.admin.Exec(ctx, soakParkLogSQL(pgx.Identifier{h.parked.Schema, "retry_parked_key"}.Sanitize())); err != nil {
		return fmt.Errorf("create soak_park_log: %w", err)
	}
	if _, err := h.admin.Exec(ctx, soakTablesSQL); err != nil {
		return fmt.Errorf("create soak tables: %w", err)
	}
	if _, err := h.admin.Exec(ctx, soakLeaseTakeoverSQL(h.leaseTable())); err != nil {
		return fmt.Errorf("create soak_lease_takeover: %w", err)
	}
	return nil
}

// createDatabase connects the maintenance pool, creates the run's database
// and connects the admin pool to it, in the run's schema (created).
func (h *harness) createDatabase(ctx context.Context) error {
	pc, err := pgxpool.ParseConfig(h.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("parse %s: %w", h.cfg.DatabaseURL, err)
	}
	pc.ConnConfig.RuntimeParams["application_name"] = h.appName("maint")
	pc.MaxConns = 2
	if h.maint, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return fmt.Errorf("connect %s: %w", h.cfg.DatabaseURL, err)
	}
	if _, err := h.maint.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{h.dbName}.Sanitize()); err != nil {
		h.dbName = "" // nothing to drop
		return fmt.Errorf("create database: %w", err)
	}
	h.admin, err = h.pool(ctx, "admin", 4)
	if err != nil {
		return err
	}
	if _, err := h.admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{h.schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	return nil
}

// migrateLibraryTables applies the library's migrations: processed_event,
// retry_parked_key and each group's hand-off outbox (KeyOrder hands a key
// on through the outbox, to each group's first retry topic).
func (h *harness) migrateLibraryTables(ctx context.Context) error {
	if err := migrate.Up(ctx, h.admin, deduplicator.MigrationLine(h.table)); err != nil {
		return fmt.Errorf("migrate processed_event: %w", err)
	}
	if err := migrate.Up(ctx, h.admin, retrytopic.MigrationLine(h.parked)); err != nil {
		return fmt.Errorf("migrate retry_parked_key: %w", err)
	}
	for g := range groups {
		ob, err := handoffOutbox(h.schema, h.retryTopics(g), h.logger)
		if err != nil {
			return err
		}
		if err := migrate.Up(ctx, h.admin, outbox.MigrationLine(ob.Config(), h.retryTopics(g)[0])); err != nil {
			return fmt.Errorf("migrate the hand-off outbox: %w", err)
		}
	}
	return nil
}

// soakParkLogSQL logs every change of the parked-keys table parked, for
// the diagnosis of a failed run (-keep): which process parked or released
// which event, in which transaction, when.
func soakParkLogSQL(parked string) string {
	return `
CREATE TABLE soak_park_log (
    op       text        NOT NULL,
    grp      text        NOT NULL,
    k        text        NOT NULL,
    event_id uuid        NOT NULL,
    seq      bigint      NOT NULL,
    topic    text        NOT NULL,
    xid      xid8        NOT NULL DEFAULT pg_current_xact_id(),
    app      text        NOT NULL DEFAULT current_setting('application_name'),
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION soak_park_log() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    INSERT INTO soak_park_log (op, grp, k, event_id, seq, topic) VALUES (TG_OP, r.consumer_group, r.partition_key, r.event_id, r.seq, COALESCE(r.topic, ''));
    RETURN r;
END $$;
CREATE TRIGGER soak_park_log AFTER INSERT OR UPDATE OR DELETE ON ` + parked + `
    FOR EACH ROW EXECUTE FUNCTION soak_park_log();`
}

// soakTablesSQL creates the run's own tables: the events, the ledger of
// their applications and the failures planned for them.
const soakTablesSQL = `
CREATE TABLE soak_event (
    event_id  uuid   PRIMARY KEY,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL,
    fail      int    NOT NULL, -- planned transient failures (per group)
    sleep_ms  int    NOT NULL, -- the handler's time on it (the hot key's events)
    UNIQUE (aggregate, seq)
);
-- No unique key on purpose: a double application must show up as two rows.
CREATE TABLE soak_ledger (
    applied   bigserial PRIMARY KEY,
    grp       text   NOT NULL,
    event_id  uuid   NOT NULL,
    aggregate int    NOT NULL,
    seq       int    NOT NULL,
    amount    bigint NOT NULL,
    -- Where it was applied from, for the diagnosis of a failed run (-keep):
    -- the topic, the retry attempt of a copy, the consumer process.
    topic     text   NOT NULL,
    attempt   text   NOT NULL,
    instance  text   NOT NULL,
    xid       xid8   NOT NULL DEFAULT pg_current_xact_id(),
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The handler's "downstream" for the events planned to fail: how many times
-- it failed so far, per group. Written outside the handler's transaction
-- (which rolls back), so that kills and rollbacks keep the count.
CREATE TABLE soak_failure (
    grp      text NOT NULL,
    event_id uuid NOT NULL,
    failures int  NOT NULL,
    PRIMARY KEY (grp, event_id)
);`

// soakLeaseTakeoverSQL logs, in lease mode, every takeover of a lease of
// leaseTable (a new token on an existing row; renewals keep the token),
// with the owner it was taken from.
func soakLeaseTakeoverSQL(leaseTable string) string {
	return `
CREATE TABLE soak_lease_takeover (
    grp         text        NOT NULL,
    event_id    uuid        NOT NULL,
    old_owner   text        NOT NULL,
    new_owner   text        NOT NULL,
    attempts    int         NOT NULL,
    old_expires timestamptz NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION soak_lease_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_lease_takeover (grp, event_id, old_owner, new_owner, attempts, old_expires)
    VALUES (NEW.consumer_group, NEW.event_id, OLD.owner, NEW.owner, NEW.attempts, OLD.expires_at);
    RETURN NEW;
END $$;
CREATE TRIGGER soak_lease_takeover AFTER UPDATE ON ` + leaseTable + `
    FOR EACH ROW WHEN (OLD.token IS DISTINCT FROM NEW.token) EXECUTE FUNCTION soak_lease_takeover();`
}

// leaseTable is the quoted name of the run's lease table (lease mode).
func (h *harness) leaseTable() string {
	return pgx.Identifier{h.table.Schema, "processed_event_lease"}.Sanitize()
}

func (h *harness) dropDB() {
	if h.admin != nil {
		h.admin.Close()
	}
	if h.maint == nil {
		return
	}
	defer h.maint.Close()
	if h.dbName == "" {
		return
	}
	if h.cfg.KeepDatabase {
		h.report.Database = h.dbName
		h.logf("kept database %s (schema %s)", h.dbName, h.schema)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// FORCE: a disruption may have left the database refusing connections,
	// and a consumer killed late may still be disconnecting.
	if _, err := h.maint.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{h.dbName}.Sanitize()+" WITH (FORCE)"); err != nil {
		h.logf("drop database %s: %v", h.dbName, err)
	}
}
