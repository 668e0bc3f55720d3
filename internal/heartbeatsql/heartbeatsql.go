package heartbeatsql

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations are the heartbeat table's versioned templates, rendered with
// struct{ Schema string }, recorded under [Component].
var Migrations = func() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	return sub
}()

// Component keys the heartbeat table's versions in idem_schema_migration.
const Component = "idem_heartbeat"

// Sample is one heartbeat of one instance.
type Sample struct {
	Instance      string    `json:"instance"`
	StartedAt     time.Time `json:"started_at"`
	At            time.Time `json:"at"`
	ConsumerGroup string    `json:"consumer_group"`
	Mode          string    `json:"mode"`
	Version       string    `json:"version"`
	// The middleware's cumulative counters since StartedAt.
	Processed  int64 `json:"processed"`
	Duplicates int64 `json:"duplicates"`
	Failed     int64 `json:"failed"`
	Rejected   int64 `json:"rejected"`
	// OutboxBacklog is the outbox's pending rows at the beat (nil: the
	// instance reports none).
	OutboxBacklog *int64 `json:"outbox_backlog"`
}

func table(schema string) (string, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return "", fmt.Errorf("heartbeatsql: %w", err)
	}
	return ident.Quote(schema, "idem_heartbeat"), nil
}

// Beat writes s (its At is the database's now()) and, when keep > 0,
// deletes the samples of every instance older than keep, in one round trip.
func Beat(ctx context.Context, db dbx.Querier, schema string, s Sample, keep time.Duration) error {
	t, err := table(schema)
	if err != nil {
		return err
	}
	_, err = db.Exec(ctx, `WITH pruned AS (DELETE FROM `+t+` WHERE $10::interval > '0' AND at < now() - $10::interval)
INSERT INTO `+t+` (instance, started_at, consumer_group, mode, version, processed, duplicates, failed, rejected, outbox_backlog)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $11) ON CONFLICT (instance, at) DO NOTHING`,
		s.Instance, s.StartedAt, s.ConsumerGroup, s.Mode, s.Version, s.Processed, s.Duplicates, s.Failed, s.Rejected, keep, s.OutboxBacklog)
	if err != nil {
		return fmt.Errorf("heartbeatsql: beat: %w", err)
	}
	return nil
}

// Instance is an instance's last sample, and how long ago it was written.
type Instance struct {
	Sample
	Age time.Duration `json:"age"`
}

// Instances returns the last sample of each instance seen within since,
// most recently seen first.
func Instances(ctx context.Context, db dbx.Querier, schema string, since time.Duration) ([]Instance, error) {
	t, err := table(schema)
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, `SELECT * FROM (
  SELECT DISTINCT ON (instance) instance, started_at, at, consumer_group, mode, version,
         processed, duplicates, failed, rejected, outbox_backlog, now() - at AS age
  FROM `+t+` WHERE at >= now() - $1::interval ORDER BY instance, at DESC) s
ORDER BY at DESC, instance`, since)
	if err != nil {
		return nil, fmt.Errorf("heartbeatsql: instances: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Instance, error) {
		var i Instance
		err := r.Scan(&i.Instance, &i.StartedAt, &i.At, &i.ConsumerGroup, &i.Mode, &i.Version,
			&i.Processed, &i.Duplicates, &i.Failed, &i.Rejected, &i.OutboxBacklog, &i.Age)
		return i, err
	})
	if err != nil {
		return nil, fmt.Errorf("heartbeatsql: instances: %w", err)
	}
	return out, nil
}

// Point is one step of a [Series]: what every instance counted during
// [At, At+step), and how many instances wrote a sample in it.
type Point struct {
	At         time.Time `json:"at"`
	Processed  int64     `json:"processed"`
	Duplicates int64     `json:"duplicates"`
	Failed     int64     `json:"failed"`
	Rejected   int64     `json:"rejected"`
	// OutboxBacklog is the largest outbox backlog reported in the step (a
	// gauge, not an increase); 0 when none was.
	OutboxBacklog int64 `json:"outbox_backlog"`
	Instances     int64 `json:"instances"`
}

// Series returns the counters' increase per step over the last window,
// summed over the instances, and the largest outbox backlog reported in each
// step, oldest step first, one point per step (zero
// where nothing was written). An increase is the difference between two
// consecutive samples of one run (instance, started_at); the first sample of
// a run that started within the window counts from zero, so a restart never
// counts negative.
func Series(ctx context.Context, db dbx.Querier, schema string, window, step time.Duration) ([]Point, error) {
	t, err := table(schema)
	if err != nil {
		return nil, err
	}
	if step <= 0 || window < step {
		return nil, fmt.Errorf("heartbeatsql: series: step %s must be positive and at most the window %s", step, window)
	}
	rows, err := db.Query(ctx, `WITH bounds AS (SELECT date_bin($2::interval, now() - $1::interval, 'epoch') AS lo),
d AS (
  SELECT at, instance,
    processed  - coalesce(lag(processed)  OVER w, CASE WHEN started_at >= b.lo THEN 0 ELSE processed END)  AS processed,
    duplicates - coalesce(lag(duplicates) OVER w, CASE WHEN started_at >= b.lo THEN 0 ELSE duplicates END) AS duplicates,
    failed     - coalesce(lag(failed)     OVER w, CASE WHEN started_at >= b.lo THEN 0 ELSE failed END)     AS failed,
    rejected   - coalesce(lag(rejected)   OVER w, CASE WHEN started_at >= b.lo THEN 0 ELSE rejected END)   AS rejected,
    outbox_backlog
  FROM `+t+`, bounds b WHERE at >= b.lo - $2::interval
  WINDOW w AS (PARTITION BY instance, started_at ORDER BY at)
)
SELECT s.t, coalesce(sum(greatest(d.processed, 0)), 0)::bigint, coalesce(sum(greatest(d.duplicates, 0)), 0)::bigint,
  coalesce(sum(greatest(d.failed, 0)), 0)::bigint, coalesce(sum(greatest(d.rejected, 0)), 0)::bigint,
  coalesce(max(d.outbox_backlog), 0)::bigint, count(DISTINCT d.instance)
FROM bounds b, generate_series(b.lo, now(), $2::interval) s(t)
LEFT JOIN d ON d.at >= s.t AND d.at < s.t + $2::interval
GROUP BY s.t ORDER BY s.t`, window, step)
	if err != nil {
		return nil, fmt.Errorf("heartbeatsql: series: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Point, error) {
		var p Point
		err := r.Scan(&p.At, &p.Processed, &p.Duplicates, &p.Failed, &p.Rejected, &p.OutboxBacklog, &p.Instances)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("heartbeatsql: series: %w", err)
	}
	return out, nil
}
