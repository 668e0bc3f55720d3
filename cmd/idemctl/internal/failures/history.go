package failures

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/heartbeatsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/internal/svgchart"
)

// History is the overview's last hour: the instances that wrote a
// heartbeat in it, the series their samples give, and one chart per
// counter.
type History struct {
	Instances []heartbeatsql.Instance `json:"instances"`
	Series    []heartbeatsql.Point    `json:"series"`
	Step      time.Duration           `json:"step"`
	Charts    []Chart                 `json:"-"`
}

// Chart is one counter's series drawn as inline SVG.
type Chart struct {
	Title string
	SVG   string
}

// ErrNoHistory: the heartbeat table does not exist (its migration line
// was not applied: no service writes a heartbeat).
var ErrNoHistory = errors.New("failures: no heartbeat table (migrate heartbeat.MigrationLine)")

// ReadHistory reads the heartbeat table of schema over the last window, by
// step, and draws the charts: processed, duplicates, failed and rejected
// per step, and the outbox backlog the instances reported.
func ReadHistory(ctx context.Context, db dbx.Querier, schema string, window, step time.Duration) (*History, error) {
	is, err := heartbeatsql.Instances(ctx, db, schema, window)
	if _, missing := pgerr.UndefinedTable(err); missing {
		return nil, fmt.Errorf("%w: %w", ErrNoHistory, err)
	}
	if err != nil {
		return nil, err
	}
	series, err := heartbeatsql.Series(ctx, db, schema, window, step)
	if err != nil {
		return nil, err
	}
	h := &History{Instances: is, Series: series, Step: step}
	per := " per " + stepName(step)
	for _, c := range []struct {
		title string
		value func(heartbeatsql.Point) int64
	}{
		{"processed" + per, func(p heartbeatsql.Point) int64 { return p.Processed }},
		{"duplicates" + per, func(p heartbeatsql.Point) int64 { return p.Duplicates }},
		{"failed" + per, func(p heartbeatsql.Point) int64 { return p.Failed }},
		{"rejected" + per, func(p heartbeatsql.Point) int64 { return p.Rejected }},
		{"outbox backlog (largest reported)", func(p heartbeatsql.Point) int64 { return p.OutboxBacklog }},
	} {
		pts := make([]svgchart.Point, len(series))
		for i, p := range series {
			pts[i] = svgchart.Point{At: p.At, Value: float64(c.value(p))}
		}
		h.Charts = append(h.Charts, Chart{Title: c.title, SVG: svgchart.Render(svgchart.Chart{Title: c.title, Points: pts})})
	}
	return h, nil
}

func stepName(d time.Duration) string {
	if d == time.Minute {
		return "minute"
	}
	return d.String()
}
