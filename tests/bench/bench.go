// Package bench holds the benchmark sections that `make bench` runs. Every
// figure is a ratio against a baseline measured in the same process, the two
// alternated over several rounds, with the median and min–max reported: the
// machine is shared and noisy, so absolute numbers mean little.
package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Options are passed to every section.
type Options struct {
	// Short asks for a quick pass (CI smoke): fewer rounds, smaller sizes.
	Short bool
	// Rounds of baseline/subject alternation. Sections may scale it.
	Rounds int
	// DatabaseURL of the PostgreSQL server; sections create their own schema.
	DatabaseURL string
	// Brokers of a real Kafka cluster; nil means an in-process kfake broker.
	Brokers []string
	// Log receives progress lines.
	Log io.Writer
}

// Logf writes a progress line.
func (o Options) Logf(format string, args ...any) {
	if o.Log != nil {
		fmt.Fprintf(o.Log, format+"\n", args...)
	}
}

// Section is one block of docs/benchmarks.md.
type Section struct {
	Title string
	// Markdown is the body: usually a table plus a sentence on method.
	Markdown string
}

// Func runs one benchmark section.
type Func func(ctx context.Context, o Options) (Section, error)

// Registered is a named section, in the order they are run.
type Registered struct {
	Name string
	Run  Func
}

// Sections lists every section; each benchmark file adds itself in init.
var Sections []Registered

// Register adds a section. Call it from init.
func Register(name string, f Func) { Sections = append(Sections, Registered{name, f}) }

// Stats summarises repeated measurements.
type Stats struct{ Median, Min, Max float64 }

// Summarise returns the median, min and max of xs.
func Summarise(xs []float64) Stats {
	if len(xs) == 0 {
		return Stats{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	med := s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return Stats{Median: med, Min: s[0], Max: s[n-1]}
}

func (s Stats) String() string {
	return fmt.Sprintf("%.2f (%.2f–%.2f)", s.Median, s.Min, s.Max)
}

// Alternate runs baseline and subject alternately for rounds rounds (the
// order flips each round to cancel drift) and returns, per round, the
// measurements and subject/baseline ratios. Each func returns a rate (higher
// is better), e.g. messages per second.
func Alternate(rounds int, baseline, subject func() (float64, error)) (base, subj, ratios []float64, err error) {
	for i := 0; i < rounds; i++ {
		var b, s float64
		if i%2 == 0 {
			if b, err = baseline(); err != nil {
				return
			}
			if s, err = subject(); err != nil {
				return
			}
		} else {
			if s, err = subject(); err != nil {
				return
			}
			if b, err = baseline(); err != nil {
				return
			}
		}
		base, subj = append(base, b), append(subj, s)
		if b > 0 {
			ratios = append(ratios, s/b)
		}
	}
	return
}

// Rotate runs every variant once per round, in an order rotated by one each
// round (so none is always first or last), and returns rates[variant][round].
// Each func returns a rate (higher is better). Use it, like [Alternate], for
// variants that cannot share the machine call by call (each drives the
// system on its own for a while).
func Rotate(rounds int, variants ...func() (float64, error)) ([][]float64, error) {
	rates := make([][]float64, len(variants))
	for round := range rounds {
		for k := range variants {
			i := (k + round) % len(variants)
			r, err := variants[i]()
			if err != nil {
				return nil, err
			}
			rates[i] = append(rates[i], r)
		}
	}
	return rates, nil
}

// Table renders a markdown table.
func Table(header []string, rows [][]string) string {
	var b strings.Builder
	b.WriteString("| " + strings.Join(header, " | ") + " |\n|")
	for range header {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	for _, r := range rows {
		b.WriteString("| " + strings.Join(r, " | ") + " |\n")
	}
	return b.String()
}

// DB is a schema of its own on the benchmark server and a pool whose
// search_path points at it.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
	url    string
}

// NewDB creates a fresh schema named after prefix and a pool bound to it with
// at most maxConns connections. configure, if not nil, may adjust the pool
// config (tracers, dialers, runtime parameters) before it is opened. Close
// drops the schema.
func NewDB(ctx context.Context, o Options, prefix string, maxConns int32, configure func(*pgxpool.Config)) (*DB, error) {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	schema := "bench_" + prefix + "_" + hex.EncodeToString(rnd[:])
	admin, err := pgx.Connect(ctx, o.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect %s: %w", o.DatabaseURL, err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create schema: %w", err)
	}
	db := &DB{Schema: schema, url: o.DatabaseURL}
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		db.Close()
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = maxConns
	if configure != nil {
		configure(cfg)
	}
	if db.Pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// Close closes the pool and drops the schema.
func (db *DB) Close() {
	if db.Pool != nil {
		db.Pool.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, db.url)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
}

// Drive runs op in a loop on workers goroutines for d and returns the
// completed operations per second. The first error stops every worker and is
// returned.
func Drive(ctx context.Context, workers int, d time.Duration, op func(ctx context.Context, worker int) error) (float64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		n        atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	start := time.Now()
	deadline := start.Add(d)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) && ctx.Err() == nil {
				if err := op(ctx, w); err != nil {
					if !errors.Is(err, context.Canceled) {
						errOnce.Do(func() { firstErr = err; cancel() })
					}
					return
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return 0, firstErr
	}
	return float64(n.Load()) / time.Since(start).Seconds(), nil
}

// Interleave measures variants under identical conditions by alternating
// them call by call: each of workers goroutines calls ops[0], ops[1], ...,
// ops[0], ... back to back for d (worker w starts at ops[w%len(ops)], so at
// any moment the variants run side by side in equal numbers), timing each
// call. It repeats for rounds and returns rates[variant][round]: workers
// divided by the mean time of one call of that variant, i.e. the throughput
// that many workers running only that variant would reach under the same
// load. On a noisy machine this cancels drift that time-sliced alternation
// ([Alternate]) cannot: both variants see the same milliseconds.
func Interleave(ctx context.Context, rounds, workers int, d time.Duration, ops ...func(ctx context.Context) error) ([][]float64, error) {
	rates := make([][]float64, len(ops))
	for range rounds {
		busy := make([]atomic.Int64, len(ops))
		calls := make([]atomic.Int64, len(ops))
		next := make([]int, workers)
		for w := range next {
			next[w] = w % len(ops)
		}
		_, err := Drive(ctx, workers, d, func(ctx context.Context, w int) error {
			i := next[w]
			next[w] = (i + 1) % len(ops)
			start := time.Now()
			if err := ops[i](ctx); err != nil {
				return err
			}
			busy[i].Add(int64(time.Since(start)))
			calls[i].Add(1)
			return nil
		})
		if err != nil {
			return nil, err
		}
		for i := range ops {
			if calls[i].Load() == 0 {
				return nil, fmt.Errorf("interleave: variant %d never completed a call in %s", i, d)
			}
			mean := time.Duration(busy[i].Load() / calls[i].Load())
			rates[i] = append(rates[i], float64(workers)/mean.Seconds())
		}
	}
	return rates, nil
}

// Ratios returns subj[i]/base[i] for each round.
func Ratios(base, subj []float64) []float64 {
	out := make([]float64, 0, len(base))
	for i := range base {
		if i < len(subj) && base[i] > 0 {
			out = append(out, subj[i]/base[i])
		}
	}
	return out
}
