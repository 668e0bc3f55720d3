package bench

import (
	"context"
	"crypto/rand"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/migrate"
)

func init() { Register("retention", retention) }

// retentionWorkers claim new events while each retention strategy runs.
const retentionWorkers = 4

// retentionResult is one strategy's measurement.
type retentionResult struct {
	name      string
	deleted   int64
	elapsed   time.Duration
	walBytes  int64
	sizeAfter int64
	claims    int
	p99       time.Duration
	// vacuum is the VACUUM that DELETE-based retention needs afterwards
	// (autovacuum would run it); zero for DROP.
	vacuum    time.Duration
	vacuumWAL int64
	// deadLeft: dead tuples VACUUM could not remove (an older snapshot
	// elsewhere on the server holds the horizon back).
	deadLeft int64
}

// retention compares three ways to remove the half of a processed_event
// table that is older than the retention: one DELETE statement, the batched
// Cleaner, and dropping daily partitions (the partitioned layout's Cleaner).
// Each strategy gets its own freshly loaded table with the same rows (14
// days of UUIDv7 ids, half of them older than 7 days), a CHECKPOINT first
// (so each pays its full-page images), and 4 workers claiming new events
// through the whole operation (at least 1 s).
func retention(ctx context.Context, o Options) (Section, error) {
	rows := 2_000_000
	if o.Short {
		rows = 100_000
	}
	db, err := NewDB(ctx, o, "retention", retentionWorkers+2, nil)
	if err != nil {
		return Section{}, err
	}
	defer db.Close()

	// Day-aligned: the data covers [D-14d, D) and the cleaners run at D with
	// a 7-day retention, so all three remove exactly the same rows.
	d := time.Now().UTC().Truncate(24 * time.Hour)
	strategies := retentionStrategies(db, d, rows)
	rounds := min(max(o.Rounds, 1), 2) // each round loads 3 × rows: ~1 min for 2 rounds of 2M
	if o.Short {
		rounds = 1
	}
	results := make([][]retentionResult, len(strategies)) // [strategy][round]
	for round := range rounds {
		for k := range strategies {
			i := (k + round) % len(strategies) // rotate the order each round
			r, err := retentionRound(ctx, o, db, strategies[i], fmt.Sprintf("pe_%d_%d", round, i), d, rows)
			if err != nil {
				return Section{}, err
			}
			o.Logf("bench: retention: round %d, %s: %s, %d B WAL, p99 claim %s over %d claims", round+1, r.name, r.elapsed, r.walBytes, r.p99, r.claims)
			results[i] = append(results[i], r)
		}
	}
	tbl := retentionTable(results)
	md := fmt.Sprintf("%d processed_event rows over 14 days of UUIDv7 ids (one consumer group), %d of them older than the 7-day retention. "+
		"Each strategy runs on its own freshly loaded table, after a CHECKPOINT, while %d workers claim new events (BEGIN; claim; COMMIT), "+
		"%d round(s), the order rotated each round; cells are the median ratio to DROP in the same round (min–max over rounds), "+
		"then the median raw figure. WAL is the server-wide pg_current_wal_lsn() difference "+
		"(other sessions on the server add noise); size is the table with its indexes right after, without VACUUM; "+
		"claim p99 covers the claims that ran during the operation (at least 1 s). The last column is the VACUUM the DELETE strategies "+
		"still owe (autovacuum would run it; it makes the space reusable but does not shrink the files), median raw figures.\n\n",
		rows, rows/2, retentionWorkers, rounds)
	md += Table([]string{"strategy", "time", "WAL", "size after", "claim p99", "then VACUUM: time, WAL"}, tbl)
	return Section{Title: "Retention: DROP partition vs DELETE vs batched Cleaner", Markdown: md}, nil
}

// retentionStrategy is one way of removing the rows past retention: run
// removes them from tc and returns how many it removed.
type retentionStrategy struct {
	name   string
	layout deduplicator.Layout
	run    func(ctx context.Context, tc deduplicator.TableConfig) (int64, error)
}

// retentionStrategies are the strategies compared on db at d (the cleaners'
// clock), rows loaded per table.
func retentionStrategies(db *DB, d time.Time, rows int) []retentionStrategy {
	retention := deduplicator.DefaultRetention
	clock := func() time.Time { return d }
	return []retentionStrategy{
		{"DROP partitions (partitioned layout, Cleaner)", deduplicator.LayoutPartitioned, func(ctx context.Context, tc deduplicator.TableConfig) (int64, error) {
			c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: clock}, nil)
			if err != nil {
				return 0, err
			}
			res, err := c.RunOnce(ctx)
			if err == nil && len(res.PartitionsDropped) != 7 {
				err = fmt.Errorf("dropped %d partitions, want 7", len(res.PartitionsDropped))
			}
			return int64(rows / 2), err
		}},
		{"single DELETE", deduplicator.LayoutPlain, func(ctx context.Context, tc deduplicator.TableConfig) (int64, error) {
			tag, err := db.Pool.Exec(ctx, "DELETE FROM "+tc.Table+" WHERE event_id < $1", partition.Floor(d.Add(-retention)))
			return tag.RowsAffected(), err
		}},
		{"batched Cleaner (10,000 rows per tx)", deduplicator.LayoutPlain, func(ctx context.Context, tc deduplicator.TableConfig) (int64, error) {
			c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{TableConfig: tc, DB: db.Pool, NowFunc: clock}, nil)
			if err != nil {
				return 0, err
			}
			res, err := c.RunOnce(ctx)
			return res.Deleted, err
		}},
	}
}

// retentionRound loads a fresh table named table, measures s on it and
// drops it.
func retentionRound(ctx context.Context, o Options, db *DB, s retentionStrategy, table string, d time.Time, rows int) (retentionResult, error) {
	tc := deduplicator.TableConfig{Schema: db.Schema, Table: table, Layout: s.layout}
	o.Logf("bench: retention: loading %d rows for %s", rows, s.name)
	if err := loadRetentionTable(ctx, db.Pool, tc, d, rows); err != nil {
		return retentionResult{}, fmt.Errorf("%s: load: %w", s.name, err)
	}
	r, err := measureRetention(ctx, db.Pool, tc, s.run)
	if err != nil {
		return retentionResult{}, fmt.Errorf("%s: %w", s.name, err)
	}
	if r.deleted != int64(rows/2) {
		return retentionResult{}, fmt.Errorf("%s: deleted %d rows, want %d", s.name, r.deleted, rows/2)
	}
	r.name = s.name
	if _, err := db.Pool.Exec(ctx, "DROP TABLE "+tc.Table); err != nil {
		return retentionResult{}, err
	}
	return r, nil
}

// retentionTable is the section's table: per strategy, each figure over
// DROP's (results[0]) in the same round.
func retentionTable(results [][]retentionResult) [][]string {
	drops := results[0]
	dur := func(f float64) string { return time.Duration(f).Round(time.Millisecond).String() }
	size := func(f float64) string { return mib(int64(f)) }
	var tbl [][]string
	for _, rs := range results {
		claims := 0
		for _, r := range rs {
			claims += r.claims
		}
		tbl = append(tbl, []string{
			rs[0].name,
			retentionCell(rs, drops, func(r retentionResult) float64 { return float64(r.elapsed) }, dur),
			retentionCell(rs, drops, func(r retentionResult) float64 { return float64(r.walBytes) }, size),
			retentionCell(rs, drops, func(r retentionResult) float64 { return float64(r.sizeAfter) }, size),
			retentionCell(rs, drops, func(r retentionResult) float64 { return float64(r.p99) }, func(f float64) string {
				return time.Duration(f).Round(10*time.Microsecond).String() + fmt.Sprintf(", %d claims", claims)
			}),
			vacuumCell(rs),
		})
	}
	return tbl
}

// retentionCell is one figure (get) of rs: the median ratio to drops' in
// the same round (min–max over rounds), then the median raw figure.
func retentionCell(rs, drops []retentionResult, get func(retentionResult) float64, raw func(float64) string) string {
	var ratios, raws []float64
	for j, r := range rs {
		raws = append(raws, get(r))
		if base := get(drops[j]); base > 0 {
			ratios = append(ratios, get(r)/base)
		}
	}
	st := Summarise(ratios)
	if len(ratios) == 1 {
		return fmt.Sprintf("%.1f× (%s)", st.Median, raw(Summarise(raws).Median))
	}
	return fmt.Sprintf("%.1f× (%.1f–%.1f) (%s)", st.Median, st.Min, st.Max, raw(Summarise(raws).Median))
}

func vacuumCell(rs []retentionResult) string {
	var t, w []float64
	for _, r := range rs {
		t, w = append(t, float64(r.vacuum)), append(w, float64(r.vacuumWAL))
	}
	if Summarise(t).Max == 0 {
		return "none needed"
	}
	out := time.Duration(Summarise(t).Median).Round(time.Millisecond).String() + ", " + mib(int64(Summarise(w).Median))
	var dead int64
	for _, r := range rs {
		dead = max(dead, r.deadLeft)
	}
	if dead > 0 {
		out += fmt.Sprintf(" (incomplete: ~%d dead tuples left by the statistics, held back by an older snapshot elsewhere on the server)", dead)
	}
	return out
}

func mib(b int64) string {
	switch {
	case b >= 10<<20:
		return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	default:
		return fmt.Sprintf("%.0f KiB", float64(b)/(1<<10))
	}
}

// loadRetentionTable creates tc (migrated; in the partitioned layout with
// daily partitions for the 14 days before d) and COPYs rows UUIDv7 rows
// spread evenly over [d-14d, d), in id order.
func loadRetentionTable(ctx context.Context, pool *pgxpool.Pool, tc deduplicator.TableConfig, d time.Time, rows int) error {
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(tc)); err != nil {
		return err
	}
	if tc.Layout == deduplicator.LayoutPartitioned {
		for i := 1; i <= 14; i++ {
			day := d.AddDate(0, 0, -i)
			from, to := partition.Bounds(day)
			if _, err := pool.Exec(ctx, fmt.Sprintf("CREATE TABLE %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')",
				pgx.Identifier{tc.Schema, partition.Name(tc.Table, day)}.Sanitize(), pgx.Identifier{tc.Schema, tc.Table}.Sanitize(), from, to)); err != nil {
				return err
			}
		}
	} else if _, err := pool.Exec(ctx, "ALTER TABLE "+tc.Table+" SET (autovacuum_enabled = off)"); err != nil {
		return err // a vacuum running in the middle would blur the DELETE figures
	}
	span := 14 * 24 * time.Hour
	start := d.Add(-span)
	var rnd [16]byte
	i := 0
	_, err := pool.CopyFrom(ctx, pgx.Identifier{tc.Table}, []string{"event_id", "consumer_group", "processed_at"},
		pgx.CopyFromFunc(func() ([]any, error) {
			if i == rows {
				return nil, nil
			}
			at := start.Add(time.Duration(int64(span) / int64(rows) * int64(i)))
			i++
			id := partition.Floor(at)
			_, _ = rand.Read(rnd[:])
			id[7], id[9], id[10], id[11], id[12], id[13], id[14], id[15] = rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5], rnd[6], rnd[7]
			return []any{id, "bench", at.Add(time.Second)}, nil
		}))
	if err != nil {
		return err
	}
	_, err = pool.Exec(ctx, "ANALYZE "+tc.Table)
	return err
}

// measureRetention runs op after a CHECKPOINT while workers claim new
// events, and returns time, WAL, size after and the claims' p99.
func measureRetention(ctx context.Context, pool *pgxpool.Pool, tc deduplicator.TableConfig, op func(context.Context, deduplicator.TableConfig) (int64, error)) (retentionResult, error) {
	var r retentionResult
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return r, err
	}
	dd, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: "bench"}, nil)
	if err != nil {
		return r, err
	}
	stopClaims := claimWhile(ctx, pool, dd)
	defer stopClaims()
	lsn0, err := currentLSN(ctx, pool)
	if err != nil {
		return r, err
	}
	start := time.Now()
	r.deleted, err = op(ctx, tc)
	r.elapsed = time.Since(start)
	if err != nil {
		return r, err
	}
	if r.walBytes, err = walSince(ctx, pool, lsn0); err != nil {
		return r, err
	}
	if rest := time.Second - r.elapsed; rest > 0 {
		time.Sleep(rest)
	}
	latencies, err := stopClaims()
	if err != nil {
		return r, fmt.Errorf("concurrent claim: %w", err)
	}
	if err := pool.QueryRow(ctx, `SELECT CASE WHEN c.relkind = 'p'
	THEN (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(c.oid))
	ELSE pg_total_relation_size(c.oid) END::bigint
FROM pg_class c WHERE c.oid = to_regclass($1)`, tc.Table).Scan(&r.sizeAfter); err != nil {
		return r, err
	}
	if tc.Layout == deduplicator.LayoutPlain {
		if err := vacuumRetention(ctx, pool, tc, &r); err != nil {
			return r, err
		}
	}
	slices.Sort(latencies)
	r.claims = len(latencies)
	if n := len(latencies); n > 0 {
		r.p99 = latencies[min(n-1, n*99/100)]
	}
	return r, nil
}

// claimWhile runs retentionWorkers workers claiming new events with dd
// until stop, which returns the claims' latencies and the first error a
// claim met (stopping twice is harmless).
func claimWhile(ctx context.Context, pool *pgxpool.Pool, dd *deduplicator.Deduplicator) (stop func() ([]time.Duration, error)) {
	claimCtx, stopClaims := context.WithCancel(ctx)
	var (
		mu        sync.Mutex
		latencies []time.Duration
		claimErr  error
		wg        sync.WaitGroup
	)
	for range retentionWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for claimCtx.Err() == nil {
				t0 := time.Now()
				err := pgx.BeginFunc(claimCtx, pool, func(tx pgx.Tx) error {
					_, err := dd.Claim(claimCtx, tx, uuid.Must(uuid.NewV7()))
					return err
				})
				if err != nil {
					if claimCtx.Err() == nil {
						mu.Lock()
						claimErr = err
						mu.Unlock()
					}
					return
				}
				mu.Lock()
				latencies = append(latencies, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	return func() ([]time.Duration, error) {
		stopClaims()
		wg.Wait()
		return latencies, claimErr
	}
}

// vacuumRetention runs the VACUUM a DELETE strategy still owes on tc and
// records its time, its WAL and the dead tuples it left in r.
func vacuumRetention(ctx context.Context, pool *pgxpool.Pool, tc deduplicator.TableConfig, r *retentionResult) error {
	lsn0, err := currentLSN(ctx, pool)
	if err != nil {
		return err
	}
	t0 := time.Now()
	if _, err := pool.Exec(ctx, "VACUUM "+tc.Table); err != nil {
		return err
	}
	r.vacuum = time.Since(t0)
	if r.vacuumWAL, err = walSince(ctx, pool, lsn0); err != nil {
		return err
	}
	return pool.QueryRow(ctx, "SELECT pg_stat_get_dead_tuples(to_regclass($1))", tc.Table).Scan(&r.deadLeft)
}

// currentLSN is the server's WAL position.
func currentLSN(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	var lsn string
	err := pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
	return lsn, err
}

// walSince is the WAL written on the server since lsn, in bytes.
func walSince(ctx context.Context, pool *pgxpool.Pool, lsn string) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint", lsn).Scan(&n)
	return n, err
}
