package migrate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
)

// chain is a Line loaded: its versions rendered for its tables.
type chain struct {
	Line
	versions []migtable.Version
}

func (c chain) newest() int { return c.versions[len(c.versions)-1].Version }

// checkTarget refuses a direction or a target version that means nothing.
func checkTarget(dir Direction, chains []chain, target int) error {
	switch {
	case dir != DirectionUp && dir != DirectionDown:
		return fmt.Errorf("direction %q: want %q or %q", dir, DirectionUp, DirectionDown)
	case dir == DirectionUp && target < 0:
		return fmt.Errorf("target version %d: going up it must be 0 (every version) or a version", target)
	case target < -1:
		return fmt.Errorf("target version %d: going down it must be -1 (every version), 0 (one step) or a version", target)
	case target <= 0:
		return nil
	}
	for _, c := range chains {
		if !slices.ContainsFunc(c.versions, func(v migtable.Version) bool { return v.Version == target }) {
			return fmt.Errorf("target version %d is not a version of %s", target, c.Component)
		}
	}
	return nil
}

// up applies the versions of chains, chain by chain, oldest version first
// (up to target when > 0), each in its own transaction.
func up(ctx context.Context, db Beginner, chains []chain, target int) ([]MigrateVersion, error) {
	steps := []MigrateVersion{}
	for _, c := range chains {
		for _, v := range c.versions {
			if target > 0 && v.Version > target {
				break
			}
			start := time.Now()
			done, err := inTx(ctx, db, c.Schema, c.Component, v.Version, func(tx pgx.Tx, applied bool) (bool, error) {
				if applied {
					return false, nil
				}
				if _, err := tx.Exec(ctx, v.Up); err != nil {
					return false, err
				}
				if c.VerifyFunc != nil {
					if err := c.VerifyFunc(ctx, tx, v.Version); err != nil {
						return false, err
					}
				}
				_, err := tx.Exec(ctx, "INSERT INTO "+ident.Quote(c.Schema, migtable.Table)+" (component, version, name) VALUES ($1, $2, $3)", c.Component, v.Version, v.Name)
				return err == nil, err
			})
			if err != nil {
				return steps, fmt.Errorf("migration %s %d_%s: %w", c.Component, v.Version, v.Name, err)
			}
			if done {
				steps = append(steps, MigrateVersion{Component: c.Component, Version: v.Version, Name: v.Name, Duration: time.Since(start)})
			}
		}
	}
	return steps, nil
}

// down reverts, chain by chain from the last, the applied versions above
// target (target 0: the newest applied one of each chain), newest first.
func down(ctx context.Context, db Beginner, chains []chain, target int) ([]MigrateVersion, error) {
	steps := []MigrateVersion{}
	for i := len(chains) - 1; i >= 0; i-- {
		c := chains[i]
		var recorded map[int]bool
		err := readTx(ctx, db, func(tx pgx.Tx) (err error) {
			recorded, err = migtable.Recorded(ctx, tx, c.Schema, c.Component)
			return err
		})
		if err != nil {
			return steps, fmt.Errorf("migration %s down: %w", c.Component, err)
		}
		known := map[int]bool{}
		newest := 0
		for _, v := range c.versions {
			known[v.Version] = true
			if recorded[v.Version] {
				newest = v.Version
			}
		}
		for v := range recorded {
			if !known[v] && v > target {
				return steps, fmt.Errorf("migration %s down: version %d: %w", c.Component, v, ErrUnknownVersion)
			}
		}
		for j := len(c.versions) - 1; j >= 0; j-- {
			v := c.versions[j]
			if v.Version <= target || (target == 0 && v.Version != newest) {
				continue
			}
			start := time.Now()
			done, err := inTx(ctx, db, c.Schema, c.Component, v.Version, func(tx pgx.Tx, applied bool) (bool, error) {
				if !applied {
					return false, nil
				}
				if v.Down == "" {
					return false, errors.New("no down migration")
				}
				if _, err := tx.Exec(ctx, v.Down); err != nil {
					return false, err
				}
				_, err := tx.Exec(ctx, "DELETE FROM "+ident.Quote(c.Schema, migtable.Table)+" WHERE component = $1 AND version = $2", c.Component, v.Version)
				return err == nil, err
			})
			if err != nil {
				return steps, fmt.Errorf("migration %s %d_%s down: %w", c.Component, v.Version, v.Name, err)
			}
			if done {
				steps = append(steps, MigrateVersion{Component: c.Component, Version: v.Version, Name: v.Name, Duration: time.Since(start)})
			}
		}
	}
	return steps, nil
}

// inTx opens a transaction, takes the per-schema migration lock, ensures the
// schema and the migration table, tells fn whether version is applied, and
// commits.
func inTx(ctx context.Context, db Beginner, schema, component string, version int, fn func(tx pgx.Tx, isApplied bool) (bool, error)) (done bool, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	// One lock for the whole schema: concurrent CREATE ... IF NOT EXISTS can
	// still collide in the catalog, so creators must be serialised.
	if err = migtable.Lock(ctx, tx, schema); err != nil {
		return false, err
	}
	// CREATE SCHEMA needs CREATE on the database even when the schema
	// exists (IF NOT EXISTS is checked after the privilege): a migration
	// role that owns only its schema (docs/security.md) never runs it.
	var schemaExists bool
	if err = tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", schema).Scan(&schemaExists); err != nil {
		return false, err
	}
	if !schemaExists {
		if _, err = tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+ident.Quote(schema)); err != nil {
			return false, err
		}
	}
	if _, err = tx.Exec(ctx, migtable.CreateSQL(schema)); err != nil {
		return false, err
	}
	var isApplied bool
	if err = tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+ident.Quote(schema, migtable.Table)+" WHERE component = $1 AND version = $2)", component, version).Scan(&isApplied); err != nil {
		return false, err
	}
	done, err = fn(tx, isApplied)
	if err != nil {
		return false, err
	}
	if err = tx.Commit(ctx); err != nil {
		return false, err
	}
	return done, nil
}

// status compares the versions c's schema records for c with c's versions:
// each of them applied or pending, then the recorded versions c does not
// have (Unknown, with their recorded name).
func status(ctx context.Context, db dbx.Querier, c chain) ([]MigrationStatus, error) {
	var recs []MigrationStatus
	exists, err := migtable.Exists(ctx, db, c.Schema)
	if err != nil {
		return nil, err
	}
	if exists {
		rows, err := db.Query(ctx, "SELECT version, name, applied_at FROM "+ident.Quote(c.Schema, migtable.Table)+" WHERE component = $1 ORDER BY version", c.Component)
		if err != nil {
			return nil, err
		}
		recs, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (MigrationStatus, error) {
			s := MigrationStatus{Component: c.Component, Applied: true}
			var v int32
			err := r.Scan(&v, &s.Name, &s.AppliedAt)
			s.Version = int(v)
			return s, err
		})
		if err != nil {
			return nil, err
		}
	}
	byVersion := make(map[int]MigrationStatus, len(recs))
	for _, r := range recs {
		byVersion[r.Version] = r
	}
	out := make([]MigrationStatus, 0, len(c.versions)+len(recs))
	for _, v := range c.versions {
		s := MigrationStatus{Component: c.Component, Version: v.Version, Name: v.Name}
		if r, ok := byVersion[v.Version]; ok {
			s.Applied, s.AppliedAt = true, r.AppliedAt
			delete(byVersion, v.Version)
		}
		out = append(out, s)
	}
	for _, r := range recs {
		if _, ok := byVersion[r.Version]; ok {
			r.Unknown = true
			out = append(out, r)
		}
	}
	return out, nil
}

// readTx runs fn in a transaction (a savepoint when db is a pgx.Tx) that is
// rolled back: fn only reads.
func readTx(ctx context.Context, db Beginner, fn func(tx pgx.Tx) error) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return fn(tx)
}
